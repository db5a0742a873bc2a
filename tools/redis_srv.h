/*
 * tools/redis_srv.h - a private redis-server for tests and benchmarks: on a
 * free loopback port, with a temporary directory, no persistence; stopped
 * (and its directory removed) at the end. POSIX only; no kvpool knowledge.
 *
 *   redis_srv r;
 *   if (redis_srv_start(&r)) { printf("skip: %s\n", r.why); ... }
 *   ... r.url is "redis://127.0.0.1:<port>" ...
 *   redis_srv_stop(&r);
 */
#ifndef KVP_REDIS_SRV_H
#define KVP_REDIS_SRV_H

#include <arpa/inet.h>
#include <dirent.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

typedef struct redis_srv {
  pid_t pid;          /* the server, or 0 */
  int port;           /* its port */
  char dir[64];       /* its working directory */
  char url[64];       /* redis://127.0.0.1:<port> */
  char why[160];      /* why it could not start */
} redis_srv;

static inline const char *redis_srv_binary(void) {
  static const char *const where[] = {"/usr/bin/redis-server", "/usr/local/bin/redis-server", "/usr/sbin/redis-server"};
  for (size_t i = 0; i < sizeof where / sizeof *where; i++)
    if (access(where[i], X_OK) == 0) return where[i];
  return NULL;
}

static inline int redis_srv_free_port(void) {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  struct sockaddr_in a = {0};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t n = sizeof a;
  int port = -1;
  if (fd >= 0 && bind(fd, (struct sockaddr *)&a, sizeof a) == 0 && getsockname(fd, (struct sockaddr *)&a, &n) == 0)
    port = ntohs(a.sin_port);
  if (fd >= 0) close(fd);
  return port;
}

/* Is something accepting on the port? */
static inline int redis_srv_up(int port) {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  struct sockaddr_in a = {0};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = htons((uint16_t)port);
  int ok = fd >= 0 && connect(fd, (struct sockaddr *)&a, sizeof a) == 0;
  if (fd >= 0) close(fd);
  return ok;
}

/* Start (again, on the same port and directory when r->pid is 0 and r->port
 * set: a restart after a kill). 0 on success. */
static inline int redis_srv_launch(redis_srv *r) {
  const char *bin = redis_srv_binary();
  if (!bin) {
    snprintf(r->why, sizeof r->why, "redis-server not found (install it: make deps)");
    return -1;
  }
  char port[16];
  snprintf(port, sizeof port, "%d", r->port);
  pid_t pid = fork();
  if (pid < 0) {
    snprintf(r->why, sizeof r->why, "fork failed");
    return -1;
  }
  if (pid == 0) {
    int devnull = open("/dev/null", 1);
    if (devnull >= 0) dup2(devnull, 1), dup2(devnull, 2);
    execl(bin, bin, "--port", port, "--bind", "127.0.0.1", "--dir", r->dir, "--save", "", "--appendonly", "no",
          "--protected-mode", "no", "--daemonize", "no", "--proto-max-bulk-len", "1gb", (char *)NULL);
    _exit(127);
  }
  r->pid = pid;
  for (int i = 0; i < 500; i++) { /* up to 5 s */
    if (redis_srv_up(r->port)) return 0;
    int st;
    if (waitpid(pid, &st, WNOHANG) == pid) {
      r->pid = 0;
      snprintf(r->why, sizeof r->why, "redis-server exited at start (status %d)", st);
      return -1;
    }
    struct timespec ts = {0, 10 * 1000 * 1000};
    nanosleep(&ts, NULL);
  }
  snprintf(r->why, sizeof r->why, "redis-server did not listen on port %d", r->port);
  return -1;
}

static inline int redis_srv_start(redis_srv *r) {
  memset(r, 0, sizeof *r);
  snprintf(r->dir, sizeof r->dir, "/tmp/kvp-redis-XXXXXX");
  if (!redis_srv_binary()) {
    snprintf(r->why, sizeof r->why, "redis-server not found (install it: make deps)");
    return -1;
  }
  if (!mkdtemp(r->dir)) {
    snprintf(r->why, sizeof r->why, "mkdtemp failed");
    return -1;
  }
  if ((r->port = redis_srv_free_port()) <= 0) {
    snprintf(r->why, sizeof r->why, "no free port");
    return -1;
  }
  snprintf(r->url, sizeof r->url, "redis://127.0.0.1:%d", r->port);
  return redis_srv_launch(r);
}

/* Kill with sig (SIGKILL: the server dies mid-command) and reap it. */
static inline void redis_srv_kill(redis_srv *r, int sig) {
  if (!r->pid) return;
  kill(r->pid, sig);
  if (sig == SIGKILL || sig == SIGTERM) {
    waitpid(r->pid, NULL, 0);
    r->pid = 0;
  }
}

static inline void redis_srv_stop(redis_srv *r) {
  if (r->pid) {
    kill(r->pid, SIGCONT);
    redis_srv_kill(r, SIGTERM);
  }
  if (r->dir[0]) {
    DIR *d = opendir(r->dir);
    struct dirent *e;
    char path[400];
    while (d && (e = readdir(d)))
      if (strcmp(e->d_name, ".") && strcmp(e->d_name, "..")) {
        snprintf(path, sizeof path, "%s/%s", r->dir, e->d_name);
        unlink(path);
      }
    if (d) closedir(d);
    rmdir(r->dir);
    r->dir[0] = 0;
  }
}

#endif

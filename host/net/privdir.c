/* privdir.c: finds, or makes, this user's private directory (see privdir.h),
 * and sweeps the sockets dead ranks left in it: the whole filesystem policy of
 * the socket directory, here where the C tests reach it (bindings/l_conn.c only
 * passes it to Lua). What is checked is the directory itself, opened without
 * following a symbolic link, so the directory made private is the one that was
 * checked; and the directory it is in, so that nobody else can rename it away
 * and put one of theirs in its place. */
#include "privdir.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <pwd.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/file.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

/* Appends one formatted candidate to out[*n] (one that does not fit, or repeats
 * the one before, is left out). */
__attribute__((format(printf, 4, 5))) static void add(char out[][RH_PRIVDIR_PATH], int *n, int max, const char *fmt,
                                                      ...) {
  if (*n >= max) return;
  va_list ap;
  va_start(ap, fmt);
  int len = vsnprintf(out[*n], RH_PRIVDIR_PATH, fmt, ap);
  va_end(ap);
  if (len > 0 && len < RH_PRIVDIR_PATH && (*n == 0 || strcmp(out[*n], out[*n - 1]) != 0)) (*n)++;
}

int rh_privdir_candidates(const char *xdg, const char *run_user, const char *tmpdir, const char *home, unsigned uid,
                          char out[][RH_PRIVDIR_PATH], int max) {
  int n = 0;
  char p[RH_PRIVDIR_PATH];
  struct stat st;
  if (xdg && *xdg) add(out, &n, max, "%s/rpchost", xdg);
  /* (the runtime directory systemd makes for a user, where XDG_RUNTIME_DIR
   * would point in a login session: only when it is there and ours) */
  if (run_user && *run_user && (size_t)snprintf(p, sizeof p, "%s/%u", run_user, uid) < sizeof p && lstat(p, &st) == 0 &&
      S_ISDIR(st.st_mode) && st.st_uid == uid)
    add(out, &n, max, "%s/rpchost", p);
  add(out, &n, max, "%s/rpchost-%u", tmpdir && *tmpdir ? tmpdir : "/tmp", uid);
  if (home && *home) add(out, &n, max, "%s/.cache/rpchost", home);
  return n;
}

__attribute__((format(printf, 3, 4))) static int fail(char *why, size_t whylen, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(why, whylen, fmt, ap);
  va_end(ap);
  return RH_ENOPRIVDIR;
}

/* "uid 1001 (mallory)", or "uid 1001" for one without a name */
static const char *owner(uid_t uid, char *out, size_t len) {
  struct passwd pw, *res = NULL;
  char buf[2048];
  if (getpwuid_r(uid, &pw, buf, sizeof buf, &res) == 0 && res)
    snprintf(out, len, "uid %u (%s)", (unsigned)uid, pw.pw_name);
  else snprintf(out, len, "uid %u", (unsigned)uid);
  return out;
}

/* The directory path is in: this user's or root's, and one that others cannot
 * write, or may write but not rename others' entries in (sticky, as /tmp). A
 * missing one is made (mode 0700: ~/.cache). */
static int check_parent(const char *path, uid_t me, char *why, size_t whylen) {
  char dir[RH_PRIVDIR_PATH], who[160];
  snprintf(dir, sizeof dir, "%s", path);
  char *slash = strrchr(dir, '/');
  if (!slash) return fail(why, whylen, "%s is not an absolute path", path);
  if (slash == dir) slash[1] = 0;
  else *slash = 0;
  struct stat st;
  if (lstat(dir, &st) != 0 && (errno != ENOENT || mkdir(dir, 0700) != 0 || lstat(dir, &st) != 0))
    return fail(why, whylen, "cannot make %s: %s", path, strerror(errno));
  if (S_ISLNK(st.st_mode) && st.st_uid != me && st.st_uid != 0)
    return fail(why, whylen, "%s is in %s, a symbolic link made by %s", path, dir, owner(st.st_uid, who, sizeof who));
  if (stat(dir, &st) != 0 || !S_ISDIR(st.st_mode)) return fail(why, whylen, "%s is in %s, not a directory", path, dir);
  if (st.st_uid != me && st.st_uid != 0)
    return fail(why, whylen, "%s is in %s, which belongs to %s", path, dir, owner(st.st_uid, who, sizeof who));
  if ((st.st_mode & 022) && !(st.st_mode & S_ISVTX))
    return fail(why, whylen, "%s is in %s, which others can write (mode %04o): they could replace it", path, dir,
                (unsigned)(st.st_mode & 07777));
  return 0;
}

int rh_privdir_check(const char *path, char *why, size_t whylen) {
  uid_t me = getuid();
  char who[160];
  int rc = check_parent(path, me, why, whylen);
  if (rc) return rc;
  if (mkdir(path, 0700) != 0 && errno != EEXIST) return fail(why, whylen, "cannot make %s: %s", path, strerror(errno));
  struct stat st;
  if (lstat(path, &st) != 0) return fail(why, whylen, "cannot make %s: %s", path, strerror(errno));
  if (S_ISLNK(st.st_mode)) {
    if (st.st_uid == me) return fail(why, whylen, "%s is a symbolic link", path);
    return fail(why, whylen, "%s is a symbolic link made by %s", path, owner(st.st_uid, who, sizeof who));
  }
  if (!S_ISDIR(st.st_mode)) return fail(why, whylen, "%s is not a directory", path);
  if (st.st_uid != me) return fail(why, whylen, "%s belongs to %s", path, owner(st.st_uid, who, sizeof who));
  /* (what was looked at above may have been replaced since: what is made
   * private is what this opens, checked again) */
  int fd = open(path, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
  if (fd < 0) return fail(why, whylen, "cannot open %s: %s", path, strerror(errno));
  rc = 0;
  if (fstat(fd, &st) != 0 || !S_ISDIR(st.st_mode) || st.st_uid != me)
    rc = fail(why, whylen, "%s was replaced while it was checked", path);
  else if (st.st_mode & 022)
    rc = fail(why, whylen, "%s is this user's but others can write it (mode %04o): remove it, and it is made again",
              path, (unsigned)(st.st_mode & 07777));
  else if ((st.st_mode & 07777) != 0700 && fchmod(fd, 0700) != 0)
    rc = fail(why, whylen, "cannot make %s private (mode 0700): %s", path, strerror(errno));
  close(fd);
  return rc;
}

int rh_privdir_find(char cands[][RH_PRIVDIR_PATH], int n, char *why, size_t whylen) {
  size_t used = (size_t)snprintf(why, whylen,
                                 "no private directory of this user (mode 0700) for sockets and "
                                 "world secrets:");
  for (int i = 0; i < n; i++) {
    char one[RH_PRIVDIR_PATH + 256];
    if (rh_privdir_check(cands[i], one, sizeof one) == 0) return i;
    if (used < whylen) used += (size_t)snprintf(why + used, whylen - used, "%s %s", i ? ";" : "", one);
  }
  if (used < whylen)
    snprintf(why + used, whylen - used, "; set XDG_RUNTIME_DIR to a directory only you can enter (mode 0700)");
  return RH_ENOPRIVDIR;
}

int rh_privdir_get(const char *sub, char *out, size_t outlen, char *why, size_t whylen) {
  char cands[RH_PRIVDIR_MAX][RH_PRIVDIR_PATH];
  int n = rh_privdir_candidates(getenv("XDG_RUNTIME_DIR"), "/run/user", getenv("RPCHOST_TMPDIR"), getenv("HOME"),
                                (unsigned)getuid(), cands, RH_PRIVDIR_MAX);
  int i = rh_privdir_find(cands, n, why, whylen);
  if (i < 0) return RH_ENOPRIVDIR;
  snprintf(out, outlen, "%s%s%s", cands[i], sub ? "/" : "", sub ? sub : "");
  if (sub && rh_privdir_check(out, why, whylen) != 0) return RH_ENOPRIVDIR;
  return 0;
}

int rh_privdir_hold(const char *path) {
  int fd = open(path, O_RDONLY | O_CLOEXEC | O_NOFOLLOW);
  if (fd < 0) return -errno;
  if (flock(fd, LOCK_SH | LOCK_NB) != 0) {
    int err = errno;
    close(fd);
    return -err;
  }
  return fd;
}

/* world-<digits>.key, or its temporary world-<digits>.key.tmp<digits> */
static int is_world_secret(const char *name) {
  if (strncmp(name, "world-", 6) != 0) return 0;
  const char *p = name + 6;
  if (*p < '0' || *p > '9') return 0;
  while (*p >= '0' && *p <= '9') p++;
  if (strncmp(p, ".key", 4) != 0) return 0;
  p += 4;
  if (*p == 0) return 1;
  if (strncmp(p, ".tmp", 4) != 0) return 0;
  p += 4;
  if (*p < '0' || *p > '9') return 0;
  while (*p >= '0' && *p <= '9') p++;
  return *p == 0;
}

/* Whether something listens on TCP port `port` of 127.0.0.1 (a loopback
 * connect answers at once). */
static int port_in_use(long port) {
  if (port <= 0 || port > 65535) return 0;
  int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return 1;
  struct sockaddr_in a;
  memset(&a, 0, sizeof a);
  a.sin_family = AF_INET;
  a.sin_port = htons((uint16_t)port);
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  int used = connect(fd, (struct sockaddr *)&a, sizeof a) == 0 || errno != ECONNREFUSED;
  close(fd);
  return used;
}

/* Removes a world secret that no store holds any more (see rh_privdir_hold):
 * 1 when it did. A file whose lock is free is checked to be still the one at
 * that name before it goes (a new store may have just written its own). (A
 * store still listening on its port keeps its file all the same: one started
 * by an rpchost that held no lock.) */
static int sweep_secret(const char *path, const char *name, time_t now, double min_age, uid_t me) {
  struct stat st, held;
  if (lstat(path, &st) != 0 || !S_ISREG(st.st_mode) || st.st_uid != me) return 0;
  if (difftime(now, st.st_mtime) < min_age) return 0;
  if (port_in_use(strtol(name + 6, NULL, 10))) return 0;
  int fd = open(path, O_RDONLY | O_CLOEXEC | O_NOFOLLOW);
  if (fd < 0) return 0;
  int gone = 0;
  if (flock(fd, LOCK_EX | LOCK_NB) == 0 && fstat(fd, &held) == 0 && held.st_ino == st.st_ino &&
      held.st_dev == st.st_dev && lstat(path, &st) == 0 && st.st_ino == held.st_ino && unlink(path) == 0)
    gone = 1;
  close(fd);
  return gone;
}

int rh_privdir_sweep(const char *dir, double min_age) {
  DIR *d = opendir(dir);
  int removed = 0;
  if (!d) return 0;
  time_t now = time(NULL);
  uid_t me = getuid();
  struct dirent *e;
  while ((e = readdir(d)) != NULL) {
    size_t n = strlen(e->d_name);
    if (strstr(e->d_name, ".luac")) {
      /* (compiled modules where earlier versions kept them: they live in the
       * bytecode subdirectory now, and thousands of them here made every sweep
       * read them all) */
      char p[1024];
      struct stat st;
      if ((size_t)snprintf(p, sizeof p, "%s/%s", dir, e->d_name) < sizeof p && lstat(p, &st) == 0 &&
          S_ISREG(st.st_mode) && st.st_uid == me)
        unlink(p);
      continue;
    }
    if (is_world_secret(e->d_name)) {
      char p[1024];
      if ((size_t)snprintf(p, sizeof p, "%s/%s", dir, e->d_name) < sizeof p)
        removed += sweep_secret(p, e->d_name, now, min_age, me);
      continue;
    }
    if (n < 6 || strcmp(e->d_name + n - 5, ".sock") != 0) continue;
    struct sockaddr_un a;
    memset(&a, 0, sizeof a);
    a.sun_family = AF_UNIX;
    if ((size_t)snprintf(a.sun_path, sizeof a.sun_path, "%s/%s", dir, e->d_name) >= sizeof a.sun_path) continue;
    struct stat st;
    if (lstat(a.sun_path, &st) != 0 || !S_ISSOCK(st.st_mode) || st.st_uid != me) continue;
    if (difftime(now, st.st_mtime) < min_age) continue;
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (fd < 0) break;
    int rc = connect(fd, (struct sockaddr *)&a, sizeof a);
    int err = rc == 0 ? 0 : errno;
    close(fd);
    if (err == ECONNREFUSED && unlink(a.sun_path) == 0) removed++;
  }
  closedir(d);
  return removed;
}

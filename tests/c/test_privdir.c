/* test_privdir.c: the private directory's policy (privdir.h) in a scratch tree.
 * The candidates come in order, /run/user/<uid> only when it is this user's;
 * a directory is made 0700, or one of ours made private; a symbolic link, a
 * file, a directory of another user (where the test runs as root: chowned to
 * nobody), one others can write, and one in a directory where others could
 * replace it are refused, each named in one clause; the first good candidate
 * wins; when none is good, the message names every one and what to do. The
 * process's own directory comes from its environment (XDG_RUNTIME_DIR first),
 * with a subdirectory checked the same way; the sweep removes the socket files
 * nobody listens on (old enough) and leftover compiled modules, and nothing else. */
#include <fcntl.h>
#include <pwd.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#include "net/privdir.h"
#include "test_check.h"

static char root[64];

static const char *at(const char *rel) {
  static char buf[4][RH_PRIVDIR_PATH];
  static int k;
  k = (k + 1) % 4;
  snprintf(buf[k], sizeof buf[k], "%s/%s", root, rel);
  return buf[k];
}

static unsigned mode_of(const char *p) {
  struct stat st;
  return lstat(p, &st) == 0 ? (unsigned)(st.st_mode & 07777) : 0;
}

static int has(const char *s, const char *part) {
  if (strstr(s, part)) return 1;
  fprintf(stderr, "  \"%s\" does not say \"%s\"\n", s, part);
  return 0;
}

/* a Unix-domain socket file at path: listening (its descriptor returned) or
 * left behind by a closed one (-1 returned); its times set `age` seconds back */
static int socket_file(const char *path, int listening, int age) {
  struct sockaddr_un a;
  memset(&a, 0, sizeof a);
  a.sun_family = AF_UNIX;
  snprintf(a.sun_path, sizeof a.sun_path, "%s", path);
  int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  CHECK(fd >= 0 && bind(fd, (struct sockaddr *)&a, sizeof a) == 0);
  if (listening) CHECK(listen(fd, 1) == 0);
  struct timespec t[2];
  clock_gettime(CLOCK_REALTIME, &t[0]);
  t[0].tv_sec -= age;
  t[1] = t[0];
  CHECK(utimensat(AT_FDCWD, path, t, AT_SYMLINK_NOFOLLOW) == 0);
  if (listening) return fd;
  close(fd);
  return -1;
}

static void plain_file(const char *path) {
  FILE *f = fopen(path, "w");
  CHECK(f != NULL);
  if (f) fclose(f);
}

static void sweep(void) {
  CHECK(mkdir(at("sockets"), 0700) == 0);
  int live = socket_file(at("sockets/live.sock"), 1, 100);
  socket_file(at("sockets/dead.sock"), 0, 100);
  socket_file(at("sockets/young.sock"), 0, 0);
  plain_file(at("sockets/file.sock"));
  plain_file(at("sockets/old.luac"));
  /* the dead socket, old enough, and the compiled module go (only sockets are counted) */
  CHECK(rh_privdir_sweep(at("sockets"), 10) == 1);
  CHECK(access(at("sockets/dead.sock"), F_OK) != 0);
  CHECK(access(at("sockets/old.luac"), F_OK) != 0);
  CHECK(access(at("sockets/live.sock"), F_OK) == 0);
  CHECK(access(at("sockets/young.sock"), F_OK) == 0);
  CHECK(access(at("sockets/file.sock"), F_OK) == 0);
  /* with no minimum age the young dead one goes too; a listener never does */
  CHECK(rh_privdir_sweep(at("sockets"), 0) == 1);
  CHECK(access(at("sockets/young.sock"), F_OK) != 0);
  CHECK(access(at("sockets/live.sock"), F_OK) == 0);
  close(live);
  CHECK(rh_privdir_sweep(at("missing"), 0) == 0);
}

/* the process's directory: XDG_RUNTIME_DIR's rpchost when that is good */
static void from_environment(void) {
  char path[RH_PRIVDIR_PATH + 64], why[4096], want[RH_PRIVDIR_PATH + 64];
  CHECK(mkdir(at("xdg"), 0700) == 0);
  setenv("XDG_RUNTIME_DIR", at("xdg"), 1);
  CHECK(rh_privdir_get(NULL, path, sizeof path, why, sizeof why) == 0);
  CHECK(strcmp(path, at("xdg/rpchost")) == 0 && mode_of(path) == 0700);
  CHECK(rh_privdir_get("bytecode", path, sizeof path, why, sizeof why) == 0);
  snprintf(want, sizeof want, "%s", at("xdg/rpchost/bytecode"));
  CHECK(strcmp(path, want) == 0 && mode_of(path) == 0700);
  /* a subdirectory that is not good is refused, saying why */
  CHECK(symlink(at("xdg"), at("xdg/rpchost/linked")) == 0);
  CHECK(rh_privdir_get("linked", path, sizeof path, why, sizeof why) == RH_ENOPRIVDIR);
  CHECK(has(why, "linked is a symbolic link"));
}

int main(void) {
  snprintf(root, sizeof root, "/tmp/rh-privdir-XXXXXX");
  CHECK(mkdtemp(root) != NULL);
  unsigned me = (unsigned)getuid();
  int is_root = me == 0;
  char why[4096];
  char c[RH_PRIVDIR_MAX][RH_PRIVDIR_PATH];

  /* candidates: in order; /run/user/<uid> only when there and ours; TMPDIR
   * unset is /tmp; empty values are skipped */
  int n = rh_privdir_candidates("/x", at("run"), NULL, "/h", me, c, RH_PRIVDIR_MAX);
  CHECK(n == 3);
  char want[RH_PRIVDIR_PATH + 32];
  snprintf(want, sizeof want, "/tmp/rpchost-%u", me);
  CHECK(strcmp(c[0], "/x/rpchost") == 0 && strcmp(c[1], want) == 0 && strcmp(c[2], "/h/.cache/rpchost") == 0);
  char ru[RH_PRIVDIR_PATH];
  snprintf(ru, sizeof ru, "%s/%u", at("run"), me);
  CHECK(mkdir(at("run"), 0755) == 0 && mkdir(ru, 0700) == 0);
  n = rh_privdir_candidates("", at("run"), "/t", "", me, c, RH_PRIVDIR_MAX);
  snprintf(want, sizeof want, "%s/rpchost", ru);
  CHECK(n == 2 && strcmp(c[0], want) == 0);
  snprintf(want, sizeof want, "/t/rpchost-%u", me);
  CHECK(strcmp(c[1], want) == 0);
  n = rh_privdir_candidates(ru, at("run"), "/t", NULL, me, c, RH_PRIVDIR_MAX); /* (the same one once) */
  CHECK(n == 2);
  if (is_root) {
    CHECK(chown(ru, 65534, 65534) == 0);
    CHECK(rh_privdir_candidates(NULL, at("run"), "/t", NULL, me, c, RH_PRIVDIR_MAX) == 1);
  }

  /* made, mode 0700; ours at 0755 made private; a missing parent is made */
  CHECK(rh_privdir_check(at("fresh"), why, sizeof why) == 0);
  CHECK(mode_of(at("fresh")) == 0700);
  CHECK(mkdir(at("open"), 0755) == 0 && chmod(at("open"), 0755) == 0);
  CHECK(rh_privdir_check(at("open"), why, sizeof why) == 0);
  CHECK(mode_of(at("open")) == 0700);
  CHECK(mkdir(at("home"), 0755) == 0);
  CHECK(rh_privdir_check(at("home/.cache/rpchost"), why, sizeof why) == 0);
  CHECK(mode_of(at("home/.cache")) == 0700);
  CHECK(mode_of(at("home/.cache/rpchost")) == 0700);
  /* a subdirectory of a private directory */
  CHECK(rh_privdir_check(at("fresh/bytecode"), why, sizeof why) == 0);

  /* refused, each saying why */
  CHECK(mkdir(at("squatter"), 0755) == 0);
  CHECK(symlink(at("squatter"), at("link")) == 0);
  CHECK(rh_privdir_check(at("link"), why, sizeof why) == RH_ENOPRIVDIR);
  CHECK(has(why, "is a symbolic link"));
  CHECK(mode_of(at("squatter")) == 0755); /* (nothing done through the link) */
  FILE *f = fopen(at("file"), "w");
  CHECK(f != NULL);
  if (f) fclose(f);
  CHECK(rh_privdir_check(at("file"), why, sizeof why) == RH_ENOPRIVDIR);
  CHECK(has(why, "is not a directory"));
  CHECK(mkdir(at("shared"), 0777) == 0 && chmod(at("shared"), 0777) == 0);
  CHECK(rh_privdir_check(at("shared"), why, sizeof why) == RH_ENOPRIVDIR);
  CHECK(has(why, "others can write it (mode 0777)"));
  CHECK(mkdir(at("public"), 0777) == 0 && chmod(at("public"), 0777) == 0);
  CHECK(rh_privdir_check(at("public/rpchost"), why, sizeof why) == RH_ENOPRIVDIR);
  CHECK(has(why, "which others can write (mode 0777)"));
  CHECK(mkdir(at("sticky"), 0777) == 0 && chmod(at("sticky"), 01777) == 0); /* (as /tmp) */
  CHECK(rh_privdir_check(at("sticky/rpchost"), why, sizeof why) == 0);
  if (is_root) {
    CHECK(mkdir(at("theirs"), 0700) == 0 && chown(at("theirs"), 65534, 65534) == 0);
    CHECK(rh_privdir_check(at("theirs"), why, sizeof why) == RH_ENOPRIVDIR);
    CHECK(has(why, "theirs belongs to uid 65534"));
    struct passwd *pw = getpwuid(65534);
    char name[128];
    snprintf(name, sizeof name, "(%s)", pw ? pw->pw_name : "");
    if (pw) CHECK(has(why, name));
    CHECK(rh_privdir_check(at("theirs/rpchost"), why, sizeof why) == RH_ENOPRIVDIR);
    CHECK(has(why, "which belongs to uid 65534"));
  } else {
    fprintf(stderr, "(not root: a directory of another user is not tried)\n");
  }

  /* the first good candidate wins; with none, every one is named */
  snprintf(c[0], RH_PRIVDIR_PATH, "%s", at("link"));
  snprintf(c[1], RH_PRIVDIR_PATH, "%s", at("shared"));
  snprintf(c[2], RH_PRIVDIR_PATH, "%s", at("good"));
  CHECK(rh_privdir_find(c, 3, why, sizeof why) == 2);
  CHECK(mode_of(at("good")) == 0700);
  CHECK(rh_privdir_find(c, 2, why, sizeof why) == RH_ENOPRIVDIR);
  CHECK(has(why, "no private directory of this user"));
  CHECK(has(why, "link is a symbolic link; "));
  CHECK(has(why, "shared is this user's but others can write it"));
  CHECK(has(why, "set XDG_RUNTIME_DIR to a directory only you can enter"));
  CHECK(strchr(why, '\n') == NULL);

  sweep();
  from_environment();

  char cmd[128];
  snprintf(cmd, sizeof cmd, "rm -rf %s", root);
  CHECK(system(cmd) == 0);
  return TEST_RESULT();
}

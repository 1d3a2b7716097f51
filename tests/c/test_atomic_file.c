/* test_atomic_file.c: saves replaced whole or not at all (host/io/atomic_file.c).
 * A committed save is the new bytes under the target's name and nothing else
 * in the directory; an aborted or failed one leaves the old file and no
 * temporary file; a save clears the temporary files of dead saves to its path
 * (this host's, pid gone) and no one else's; rewrites stay inside what was
 * written; tensors of any layout are written in logical order with the crc32
 * of those bytes; reads fill memory and tensors, and a short file is
 * RH_ETRUNCATED; a mapped tensor lies in the file copy-on-write. Runs in a
 * fresh directory under $TMPDIR. */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>
#include <zlib.h>

#include "io/atomic_file.h"
#include "rh.h"
#include "tensor_check.h"

static char dir[512];

static char *at(const char *name) {
  static char buf[4][4096];
  static int k;
  k = (k + 1) % 4;
  snprintf(buf[k], sizeof buf[k], "%s/%s", dir, name);
  return buf[k];
}

/* the bytes of a file (NUL-terminated), or NULL */
static char *slurp(const char *path, size_t *n) {
  int fd = open(path, O_RDONLY);
  if (fd < 0) return NULL;
  struct stat st;
  fstat(fd, &st);
  char *s = malloc((size_t)st.st_size + 1);
  *n = (size_t)read(fd, s, (size_t)st.st_size);
  s[*n] = 0;
  close(fd);
  return s;
}

static void put(const char *path, const char *s) {
  int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC, 0644);
  CHECK(fd >= 0 && write(fd, s, strlen(s)) == (ssize_t)strlen(s));
  close(fd);
}

/* how many entries of the directory start with prefix */
static int count_entries(const char *prefix) {
  DIR *d = opendir(dir);
  int n = 0;
  for (struct dirent *e; (e = readdir(d));) n += strncmp(e->d_name, prefix, strlen(prefix)) == 0;
  closedir(d);
  return n;
}

static void commit_and_abort(void) {
  put(at("a.bin"), "old");
  rh_afile_t f;
  CHECK(rh_afile_open(&f, at("a.bin"), &(rh_afile_opts_t){.size = 11}) == 0);
  CHECK(count_entries(".a.bin.tmp-") == 1);
  CHECK(rh_afile_write(&f, "hello world", 11) == 0 && f.offset == 11);
  CHECK(rh_afile_write_at(&f, 0, "HELLO", 5) == 0);
  CHECK(rh_afile_write_at(&f, 8, "abcd", 4) < 0 && f.state == RH_AFILE_ABORTED); /* past the end */
  size_t n;
  char *s = slurp(at("a.bin"), &n);
  CHECK(s && strcmp(s, "old") == 0); /* (the refused rewrite ended the save: old file, no temporary) */
  free(s);
  CHECK(count_entries(".a.bin.tmp-") == 0);
  CHECK(strstr(f.msg, "cannot save") && strstr(f.msg, "a.bin") && strstr(f.msg, "the old file is untouched"));
  rh_afile_abort(&f);

  CHECK(rh_afile_open(&f, at("a.bin"), NULL) == 0);
  CHECK(rh_afile_write(&f, "hello world", 11) == 0 && rh_afile_write_at(&f, 0, "HELLO", 5) == 0);
  CHECK(rh_afile_commit(&f) == 0 && f.state == RH_AFILE_COMMITTED);
  s = slurp(at("a.bin"), &n);
  CHECK(s && n == 11 && strcmp(s, "HELLO world") == 0);
  free(s);
  CHECK(count_entries(".a.bin.tmp-") == 0);
  CHECK(rh_afile_write(&f, "x", 1) != 0); /* (a committed save takes nothing more) */
  rh_afile_abort(&f);

  CHECK(rh_afile_open(&f, at("a.bin"), &(rh_afile_opts_t){.size = 1000}) ==
        0); /* (a reservation larger than what is written) */
  CHECK(rh_afile_write(&f, "new", 3) == 0);
  rh_afile_abort(&f);
  s = slurp(at("a.bin"), &n);
  CHECK(s && strcmp(s, "HELLO world") == 0);
  free(s);
  CHECK(count_entries(".a.bin.tmp-") == 0);
  CHECK(rh_afile_open(&f, at("a.bin"), &(rh_afile_opts_t){.size = 1000}) == 0 && rh_afile_write(&f, "new", 3) == 0 &&
        rh_afile_commit(&f) == 0);
  struct stat st;
  CHECK(stat(at("a.bin"), &st) == 0 && st.st_size == 3); /* (the unused reservation is released) */
}

static void modes_and_failures(void) {
  put(at("private.bin"), "secret");
  chmod(at("private.bin"), 0600);
  rh_afile_t f;
  CHECK(rh_afile_open(&f, at("private.bin"), NULL) == 0 && rh_afile_commit(&f) == 0);
  struct stat st;
  CHECK(stat(at("private.bin"), &st) == 0 && (st.st_mode & 0777) == 0600); /* the old file's mode */
  CHECK(rh_afile_open(&f, at("given.bin"), &(rh_afile_opts_t){.mode = 0640}) == 0 && rh_afile_commit(&f) == 0);
  CHECK(stat(at("given.bin"), &st) == 0 && (st.st_mode & 0777) == 0640);

  /* a directory that does not exist: one line naming the path, the step and the bytes */
  CHECK(rh_afile_open(&f, at("missing/x.bin"), &(rh_afile_opts_t){.size = 4096}) < 0);
  CHECK(strstr(f.msg, "missing/x.bin") && strstr(f.msg, "cannot create a temporary file") && strstr(f.msg, "ENOENT") &&
        strstr(f.msg, "needs 4096 bytes") && !strchr(f.msg, '\n'));
  rh_afile_abort(&f);
  /* a target that is a directory */
  mkdir(at("adir"), 0755);
  CHECK(rh_afile_open(&f, at("adir"), NULL) == 0 && rh_afile_commit(&f) < 0);
  CHECK(strstr(f.msg, "renaming") && count_entries(".adir.tmp-") == 0);
  rh_afile_abort(&f);
}

/* a pid that was this host's and is gone */
static pid_t dead_pid(void) {
  pid_t p = fork();
  if (p == 0) _exit(0);
  waitpid(p, NULL, 0);
  return p;
}

static void sweeps_dead_leftovers(void) {
  char host[64] = "";
  gethostname(host, sizeof host - 1);
  host[32] = 0;
  for (char *c = host; *c; c++)
    if (*c == '/') *c = '_';
  char name[4][300];
  snprintf(name[0], sizeof name[0], ".b.bin.tmp-%s-%d-0123abcd", host, (int)dead_pid());      /* dead: cleared */
  snprintf(name[1], sizeof name[1], ".b.bin.tmp-%s-%d-0123abcd", host, (int)getpid());        /* alive: kept */
  snprintf(name[2], sizeof name[2], ".b.bin.tmp-other%s-%d-0123abcd", host, (int)dead_pid()); /* another host */
  snprintf(name[3], sizeof name[3], ".b.bin.tmp-notes");                                      /* not a save's */
  for (int i = 0; i < 4; i++) put(at(name[i]), "leftover");
  rh_afile_t f;
  CHECK(rh_afile_open(&f, at("b.bin"), NULL) == 0 && rh_afile_commit(&f) == 0);
  CHECK(access(at(name[0]), F_OK) != 0);
  for (int i = 1; i < 4; i++) CHECK(access(at(name[i]), F_OK) == 0);
}

static void tensors_and_reads(void) {
  /* a [3, 4] float64 tensor and its transpose: written in logical order */
  rh_tensor_t *t = rh_tensor_arange(RH_F64, 0, 12, 1);
  rh_tensor_t *m = rh_tensor_view(t, 2, (int64_t[]){3, 4});
  rh_tensor_t *mt = rh_tensor_transpose(m, 0, 1);
  rh_afile_t f;
  uint32_t crc = 0, crc_t = 0;
  CHECK(rh_afile_open(&f, at("t.bin"), NULL) == 0 && rh_afile_write_tensor(&f, m, &crc) == 0 &&
        rh_afile_write_tensor(&f, mt, &crc_t) == 0 && rh_afile_commit(&f) == 0);
  size_t n;
  char *s = slurp(at("t.bin"), &n);
  CHECK(s && n == 2 * 12 * sizeof(double));
  const double *d = (const double *)s;
  for (int i = 0; i < 12; i++) CHECK(d[i] == i && d[12 + i] == (i % 3) * 4 + i / 3);
  CHECK(crc == (uint32_t)crc32(0, (const unsigned char *)s, 96));
  CHECK(crc_t == (uint32_t)crc32(0, (const unsigned char *)s + 96, 96));

  int fd = open(at("t.bin"), O_RDONLY);
  rh_tensor_t *back = rh_tensor_empty(RH_F64, 2, (int64_t[]){4, 3});
  uint32_t rcrc = 0;
  CHECK(rh_afile_read_tensor(fd, 96, back, &rcrc, 0) == 0 && rcrc == crc_t);
  CHECK(memcmp(rh_tensor_data(back), s + 96, 96) == 0);
  CHECK(rh_afile_read_tensor(fd, 100, back, NULL, 0) == RH_ETRUNCATED);
  CHECK(rh_afile_read_tensor(fd, 0, mt, NULL, 0) < 0); /* (not contiguous) */
  /* the other byte order */
  rh_tensor_t *sw = rh_tensor_empty(RH_I32, 1, (int64_t[]){2});
  CHECK(rh_afile_read_tensor(fd, 8, sw, NULL, 1) == 0);
  const unsigned char *a = (const unsigned char *)s + 8, *b = rh_tensor_data(sw);
  CHECK(b[0] == a[3] && b[1] == a[2] && b[2] == a[1] && b[3] == a[0]);
  /* mapped copy-on-write: at a multiple of 64 only; writes stay in memory */
  rh_tensor_t *mp = NULL;
  CHECK(rh_afile_map_tensor(fd, 8, RH_F64, 1, (int64_t[]){4}, &mp) == -EINVAL && !mp);
  CHECK(rh_afile_map_tensor(fd, 64, RH_F64, 2, (int64_t[]){2, 2}, &mp) == 0 && mp);
  CHECK(mp && rh_tensor_is_contiguous(mp) && memcmp(rh_tensor_data(mp), s + 64, 32) == 0);
  if (mp) ((double *)rh_tensor_data(mp))[0] = -1;
  char check[8];
  CHECK(pread(fd, check, 8, 64) == 8 && memcmp(check, s + 64, 8) == 0);
  rh_tensor_release(mp);
  close(fd);
  free(s);
  rh_tensor_release(sw);
  rh_tensor_release(back);
  rh_tensor_release(mt);
  rh_tensor_release(m);
  rh_tensor_release(t);

  /* a strided tensor bigger than a piece goes in pieces, in order */
  int64_t big = (int64_t)(RH_AFILE_PIECE / 4) + 1000;
  rh_tensor_t *r = rh_tensor_arange(RH_I32, 0, (double)(2 * big), 1);
  rh_tensor_t *r2 = rh_tensor_view(r, 2, (int64_t[]){big, 2});
  rh_tensor_t *col = rh_tensor_transpose(r2, 0, 1); /* [2, big]: row 0 the even numbers */
  CHECK(rh_afile_open(&f, at("p.bin"), NULL) == 0 && rh_afile_write_tensor(&f, col, NULL) == 0 &&
        rh_afile_commit(&f) == 0);
  s = slurp(at("p.bin"), &n);
  CHECK(s && n == (size_t)(8 * big));
  const int32_t *v = (const int32_t *)s;
  int ok = 1;
  for (int64_t i = 0; s && i < big; i++) ok &= v[i] == 2 * i && v[big + i] == 2 * i + 1;
  CHECK(ok);
  free(s);
  rh_tensor_release(col);
  rh_tensor_release(r2);
  rh_tensor_release(r);

  /* a read of several 8 MiB parts is spread over the thread pool: the same
   * bytes, and the crc of the whole (the parts' combined), continuing one
   * given before it, and a short file is still an error */
  int64_t nbig = (int64_t)(21 << 20) / 4 + 7;
  rh_tensor_t *w = rh_tensor_arange(RH_I32, 0, (double)nbig, 1), *h0 = rh_tensor_arange(RH_F64, 0, 12, 1);
  uint32_t wcrc = 0;
  CHECK(rh_afile_open(&f, at("big.bin"), NULL) == 0 && rh_afile_write_tensor(&f, h0, NULL) == 0 &&
        rh_afile_write_tensor(&f, w, &wcrc) == 0 && rh_afile_commit(&f) == 0);
  fd = open(at("big.bin"), O_RDONLY);
  rh_tensor_t *wb = rh_tensor_empty(RH_I32, 1, (int64_t[]){nbig});
  uint32_t head = (uint32_t)crc32(0, (const unsigned char *)"abc", 3), rb = head;
  CHECK(rh_afile_read_tensor(fd, 96, wb, &rb, 0) == 0);
  CHECK(rb == (uint32_t)crc32_combine(head, wcrc, (z_off_t)(nbig * 4)));
  CHECK(memcmp(rh_tensor_data(wb), rh_tensor_data(w), (size_t)nbig * 4) == 0);
  CHECK(rh_afile_read_tensor(fd, 100, wb, NULL, 0) == RH_ETRUNCATED);
  close(fd);
  rh_tensor_release(wb);
  rh_tensor_release(w);
  rh_tensor_release(h0);
}

int main(void) {
  const char *tmp = getenv("TMPDIR");
  snprintf(dir, sizeof dir, "%s/rh-atomic-XXXXXX", tmp && *tmp ? tmp : "/tmp");
  if (!mkdtemp(dir)) return 2;
  commit_and_abort();
  modes_and_failures();
  sweeps_dead_leftovers();
  tensors_and_reads();
  CHECK(rh_storage_live_bytes() == 0);
  char cmd[600];
  snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
  CHECK(system(cmd) == 0);
  return TEST_RESULT();
}

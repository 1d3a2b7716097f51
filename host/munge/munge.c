/* munge.c: libmunge through dlopen (munge.h says what for). The few constants
 * and signatures used are libmunge's stable ABI (munge.h of MUNGE 0.5, the same
 * since 2004), written here so that building needs no MUNGE headers. */
#include "munge/munge.h"

#include <dlfcn.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/types.h>

/* from MUNGE's munge.h */
enum { MUNGE_OPT_SOCKET = 8, MUNGE_OPT_UID_RESTRICTION = 9 };
typedef struct munge_ctx *munge_ctx_t;

static struct {
  void *h;
  int tried;
  int (*encode)(char **, munge_ctx_t, const void *, int);
  int (*decode)(const char *, munge_ctx_t, void **, int *, uid_t *, gid_t *);
  const char *(*strerror)(int);
  munge_ctx_t (*ctx_create)(void);
  void (*ctx_destroy)(munge_ctx_t);
  int (*ctx_set)(munge_ctx_t, int, ...);
  const char *(*ctx_strerror)(munge_ctx_t);
} m;

static _Thread_local char last[512] = "no error";

const char *rh_munge_error(void) { return last; }

static int fail(const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(last, sizeof last, fmt, ap);
  va_end(ap);
  return RH_EMUNGE;
}

static int sym(void *dst, const char *name) {
  void *p = dlsym(m.h, name);
  if (!p) return 0;
  memcpy(dst, &p, sizeof p);
  return 1;
}

int rh_munge_load(void) {
  if (m.tried) return m.h ? 0 : RH_EMUNGE;
  m.tried = 1;
  m.h = dlopen("libmunge.so.2", RTLD_NOW | RTLD_LOCAL);
  if (!m.h) return fail("cannot load libmunge.so.2: %s (install the Debian package libmunge2)", dlerror());
  int ok = sym(&m.encode, "munge_encode") && sym(&m.decode, "munge_decode") && sym(&m.strerror, "munge_strerror") &&
           sym(&m.ctx_create, "munge_ctx_create") && sym(&m.ctx_destroy, "munge_ctx_destroy") &&
           sym(&m.ctx_set, "munge_ctx_set") && sym(&m.ctx_strerror, "munge_ctx_strerror");
  if (!ok) {
    dlclose(m.h);
    m.h = NULL;
    return fail("libmunge.so.2 lacks munge_encode or another of its functions: not MUNGE 0.5?");
  }
  return 0;
}

/* a context on RPCHOST_MUNGE_SOCKET (else libmunge's default socket), or NULL */
static munge_ctx_t new_ctx(void) {
  munge_ctx_t ctx = m.ctx_create();
  if (!ctx) {
    fail("munge_ctx_create failed (out of memory)");
    return NULL;
  }
  const char *sock = getenv("RPCHOST_MUNGE_SOCKET");
  if (sock && *sock && m.ctx_set(ctx, MUNGE_OPT_SOCKET, sock) != 0) {
    fail("cannot use the MUNGE socket %s: %s", sock, m.ctx_strerror(ctx));
    m.ctx_destroy(ctx);
    return NULL;
  }
  return ctx;
}

/* a munged failure, naming the call and munged's own words */
static int munge_fail(const char *what, munge_ctx_t ctx, int rc) {
  const char *why = m.ctx_strerror(ctx);
  return fail("%s: %s", what, why ? why : m.strerror(rc));
}

int rh_munge_encode(const void *buf, int len, long decoder, char **cred) {
  int rc = rh_munge_load();
  if (rc) return rc;
  munge_ctx_t ctx = new_ctx();
  if (!ctx) return RH_EMUNGE;
  *cred = NULL;
  if (decoder >= 0 && (rc = m.ctx_set(ctx, MUNGE_OPT_UID_RESTRICTION, (uid_t)decoder)) != 0) {
    rc = munge_fail("munge_ctx_set", ctx, rc);
  } else if ((rc = m.encode(cred, ctx, buf, len)) != 0) {
    rc = munge_fail("munge_encode", ctx, rc);
    free(*cred);
    *cred = NULL;
  }
  m.ctx_destroy(ctx);
  return rc ? RH_EMUNGE : 0;
}

int rh_munge_decode(const char *cred, void **buf, int *len, long *uid, long *gid) {
  int rc = rh_munge_load();
  if (rc) return rc;
  munge_ctx_t ctx = new_ctx();
  if (!ctx) return RH_EMUNGE;
  uid_t u = (uid_t)-1;
  gid_t g = (gid_t)-1;
  *buf = NULL;
  *len = 0;
  rc = m.decode(cred, ctx, buf, len, &u, &g);
  if (rc != 0) {
    /* (some failures still hand back the payload: it is not to be used) */
    free(*buf);
    *buf = NULL;
    *len = 0;
    munge_fail("munge_decode", ctx, rc);
  }
  m.ctx_destroy(ctx);
  if (rc) return RH_EMUNGE;
  *uid = (long)u;
  *gid = (long)g;
  return 0;
}

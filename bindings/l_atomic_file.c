/* l_atomic_file.c: atomic, checked saves and direct reads for Lua
 * ("rpchost.AtomicFile", "rpchost.FileReader"), over host/io/atomic_file.h.
 * rpchost.atomic_file is the face (its top comment is the API); every save a
 * user's data goes through uses it. Failures raise one line, "WHO: cannot
 * save PATH: what failed: why; the bytes needed; the old file is untouched",
 * after the temporary file is gone; an uncommitted save that is collected is
 * aborted (its temporary file removed). Offsets are Lua numbers: whole, not
 * negative, below 2^53. */
#include <errno.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zlib.h>

#include "io/atomic_file.h"
#include "rh.h"
#include "rh_lua.h"
#include "tensor/tensor.h"

#define FILE_MT "rpchost.AtomicFile"
#define READER_MT "rpchost.FileReader"
#define WHO_MAX 64

typedef struct {
  rh_afile_t f;
  char who[WHO_MAX]; /* what the errors start with: "tensor.save" */
} lfile_t;

typedef struct {
  int fd; /* -1 once closed */
  uint64_t size;
  char *path;
  char who[WHO_MAX];
} lreader_t;

/* an offset or a length at index i: a whole number in [0, 2^53] */
static uint64_t check_offset(lua_State *L, int i) {
  lua_Number d = luaL_checknumber(L, i);
  if (!(d >= 0 && d <= 9007199254740992.0) || d != (lua_Number)(uint64_t)d)
    luaL_error(L, "bad argument #%d: expected a whole number of bytes from 0 to 2^53, got %f", i, d);
  return (uint64_t)d;
}

static void set_who(char *who, lua_State *L, int i, const char *dflt) {
  snprintf(who, WHO_MAX, "%s", luaL_optstring(L, i, dflt));
}

/* ---- saves */

static lfile_t *check_file(lua_State *L) { return luaL_checkudata(L, 1, FILE_MT); }

/* raises the message (formatted as lua_pushfstring does) as it is: one
 * line, with no position in front (luaL_error would name atomic_file.lua) */
static int raise_line(lua_State *L, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  lua_pushvfstring(L, fmt, ap);
  va_end(ap);
  return lua_error(L);
}

/* raises "WHO: <the save's message>" when rc is a failure */
static void check_rc(lua_State *L, lfile_t *b, int rc) {
  if (rc) raise_line(L, "%s: %s", b->who, b->f.msg);
}

/* opts[k] at table index t as a byte count (0 when absent) */
static uint64_t opt_bytes(lua_State *L, int t, const char *k) {
  lua_getfield(L, t, k);
  uint64_t v = lua_isnil(L, -1) ? 0 : check_offset(L, lua_gettop(L));
  lua_pop(L, 1);
  return v;
}

/* af_open(path[, {size =, size_max =, mode =, who =}]) -> a save (AtomicFile) */
static int l_open(lua_State *L) {
  const char *path = luaL_checkstring(L, 1);
  rh_afile_opts_t o = {0, 0, 0};
  lfile_t *b = lua_newuserdata(L, sizeof *b);
  memset(b, 0, sizeof *b);
  b->f.fd = -1;
  snprintf(b->who, WHO_MAX, "save");
  if (lua_istable(L, 2)) {
    o.size = opt_bytes(L, 2, "size");
    o.size_max = opt_bytes(L, 2, "size_max");
    o.mode = (int)(opt_bytes(L, 2, "mode") & 07777);
    lua_getfield(L, 2, "who");
    if (lua_isstring(L, -1)) set_who(b->who, L, -1, "save");
    lua_pop(L, 1);
  }
  luaL_getmetatable(L, FILE_MT);
  lua_setmetatable(L, -2);
  check_rc(L, b, rh_afile_open(&b->f, path, &o));
  return 1;
}

/* f:write(s, ...) -> the offset after them: appends each string */
static int l_write(lua_State *L) {
  lfile_t *b = check_file(L);
  for (int i = 2, top = lua_gettop(L); i <= top || i == 2; i++) {
    size_t n;
    const char *s = luaL_checklstring(L, i, &n);
    check_rc(L, b, rh_afile_write(&b->f, s, n));
  }
  lua_pushnumber(L, (double)b->f.offset);
  return 1;
}

/* f:write_at(offset, s): rewrites bytes already written */
static int l_write_at(lua_State *L) {
  lfile_t *b = check_file(L);
  uint64_t off = check_offset(L, 2);
  size_t n;
  const char *s = luaL_checklstring(L, 3, &n);
  check_rc(L, b, rh_afile_write_at(&b->f, off, s, n));
  return 0;
}

/* f:write_tensor(t[, crc]) -> the crc32 of the bytes written continuing crc
 * (nil when no crc is given: computing one costs a pass over the data), and
 * their count */
static int l_write_tensor(lua_State *L) {
  lfile_t *b = check_file(L);
  rh_tensor_t *t = rh_lua_checktensor(L, 2);
  int want_crc = !lua_isnoneornil(L, 3);
  uint32_t crc = want_crc ? (uint32_t)luaL_checknumber(L, 3) : 0;
  uint64_t before = b->f.offset;
  check_rc(L, b, rh_afile_write_tensor(&b->f, t, want_crc ? &crc : NULL));
  if (want_crc) lua_pushnumber(L, (double)crc);
  else lua_pushnil(L);
  lua_pushnumber(L, (double)(b->f.offset - before));
  return 2;
}

static int l_offset(lua_State *L) {
  lua_pushnumber(L, (double)check_file(L)->f.offset);
  return 1;
}

/* f:commit(): durable, then renamed over the target */
static int l_commit(lua_State *L) {
  lfile_t *b = check_file(L);
  check_rc(L, b, rh_afile_commit(&b->f));
  return 0;
}

/* f:abort(): the temporary file removed; the target untouched */
static int l_abort(lua_State *L) {
  rh_afile_abort(&check_file(L)->f);
  return 0;
}

/* f:temp_path() -> the temporary file while the save is open, else nil */
static int l_temp_path(lua_State *L) {
  lfile_t *b = check_file(L);
  if (b->f.state != RH_AFILE_OPEN || !b->f.tmp) return 0;
  lua_pushstring(L, b->f.tmp);
  return 1;
}

static int l_file_gc(lua_State *L) {
  rh_afile_abort(&check_file(L)->f);
  return 0;
}

static int l_file_tostring(lua_State *L) {
  lfile_t *b = check_file(L);
  const char *st = b->f.state == RH_AFILE_OPEN ? "open" : b->f.state == RH_AFILE_COMMITTED ? "committed" : "over";
  lua_pushfstring(L, "AtomicFile(%s, %s, %f bytes)", b->f.path ? b->f.path : "-", st, (double)b->f.offset);
  return 1;
}

/* ---- reads */

static lreader_t *check_reader(lua_State *L) {
  lreader_t *r = luaL_checkudata(L, 1, READER_MT);
  if (r->fd < 0) raise_line(L, "%s: the file reader of %s is closed", r->who, r->path ? r->path : "-");
  return r;
}

/* raises naming the path for a failed read of [off, off + n) */
static void check_read(lua_State *L, lreader_t *r, int rc, uint64_t off, uint64_t n) {
  if (!rc) return;
  if (rc == RH_ETRUNCATED || (rc == -EINVAL && off + n > r->size))
    raise_line(L, "%s: %s is truncated: it ends at byte %f, before the end of the %f bytes at %f", r->who, r->path,
               (double)r->size, (double)n, (double)off);
  raise_line(L, "%s: reading %s failed at bytes [%f, %f): %s", r->who, r->path, (double)off, (double)(off + n),
             strerror(-rc));
}

/* af_reader(path[, who]) -> a reader of path */
static int l_reader(lua_State *L) {
  const char *path = luaL_checkstring(L, 1);
  char who[WHO_MAX];
  set_who(who, L, 2, "load");
  lreader_t *r = lua_newuserdata(L, sizeof *r);
  r->fd = -1;
  r->path = NULL;
  memcpy(r->who, who, sizeof who);
  luaL_getmetatable(L, READER_MT);
  lua_setmetatable(L, -2);
  r->path = strdup(path);
  if (!r->path) return raise_line(L, "%s: out of memory", r->who);
  int fd = open(path, O_RDONLY | O_CLOEXEC);
  struct stat st;
  if (fd < 0) return raise_line(L, "%s: cannot open %s: %s", r->who, path, strerror(errno));
  if (fstat(fd, &st) != 0 || S_ISDIR(st.st_mode)) {
    int e = S_ISDIR(st.st_mode) ? EISDIR : errno;
    close(fd);
    return raise_line(L, "%s: cannot read %s: %s", r->who, path, strerror(e));
  }
  r->fd = fd;
  r->size = (uint64_t)st.st_size;
  return 1;
}

static int l_size(lua_State *L) {
  lua_pushnumber(L, (double)check_reader(L)->size);
  return 1;
}

/* r:read(offset, n) -> the n bytes at offset, as a string (headers: the data
 * goes through read_into) */
static int l_read(lua_State *L) {
  lreader_t *r = check_reader(L);
  uint64_t off = check_offset(L, 2), n = check_offset(L, 3);
  if (off > r->size || n > r->size - off) check_read(L, r, RH_ETRUNCATED, off, n);
  char *buf = malloc(n ? n : 1);
  if (!buf) return raise_line(L, "%s: out of memory reading %f bytes of %s", r->who, (double)n, r->path);
  int rc = rh_afile_read(r->fd, off, buf, n, NULL);
  if (!rc) lua_pushlstring(L, buf, n);
  free(buf);
  check_read(L, r, rc, off, n);
  return 1;
}

/* a read's options at index o (or none): {crc32 = true or an initial crc,
 * byteswap = bool, map = bool} */
typedef struct {
  int want_crc, swap, map;
  uint32_t crc;
} read_opts_t;

static read_opts_t read_opts(lua_State *L, int o) {
  read_opts_t ro = {0, 0, 0, 0};
  if (!lua_istable(L, o)) return ro;
  lua_getfield(L, o, "crc32");
  ro.want_crc = lua_toboolean(L, -1);
  if (lua_isnumber(L, -1)) ro.crc = (uint32_t)lua_tonumber(L, -1);
  lua_getfield(L, o, "byteswap");
  ro.swap = lua_toboolean(L, -1);
  lua_getfield(L, o, "map");
  ro.map = lua_toboolean(L, -1);
  lua_pop(L, 3);
  return ro;
}

/* Fills t (a contiguous host tensor) from off, continuing ro->crc when asked. */
static void fill(lua_State *L, lreader_t *r, uint64_t off, rh_tensor_t *t, read_opts_t *ro) {
  size_t n = (size_t)rh_tensor_numel(t) * rh_dtype_size(t->dtype);
  if (off > r->size || n > r->size - off) check_read(L, r, RH_ETRUNCATED, off, n);
  check_read(L, r, rh_afile_read_tensor(r->fd, off, t, ro->want_crc ? &ro->crc : NULL, ro->swap), off, n);
}

/* r:read_into(offset, t[, {crc32 = true or initial, byteswap = bool}]) -> the
 * crc32 of the bytes read (continuing the initial one) when asked: fills the
 * contiguous host tensor t with its byte size read at offset */
static int l_read_into(lua_State *L) {
  lreader_t *r = check_reader(L);
  uint64_t off = check_offset(L, 2);
  rh_tensor_t *t = rh_lua_checkhostspan(L, 3, "read_into", NULL);
  read_opts_t ro = read_opts(L, 4);
  fill(L, r, off, t, &ro);
  if (!ro.want_crc) return 0;
  lua_pushnumber(L, (double)ro.crc);
  return 1;
}

/* r:read_tensor(offset, dtype, sizes[, opts]) -> a new tensor of that dtype
 * and shape holding the bytes at offset[, the crc32 as read_into]. The file's
 * size is checked before anything is allocated: a hostile header cannot ask
 * for more memory than the file holds. With opts.map the tensor maps the
 * file copy-on-write where it can (rh_afile_map_tensor: bytes aligned to 64
 * and in this byte order), and is read where it cannot. */
static int l_read_tensor(lua_State *L) {
  lreader_t *r = check_reader(L);
  uint64_t off = check_offset(L, 2);
  int64_t size[RH_MAXDIM], numel;
  rh_dtype_t dt = rh_lua_checkdtype(L, 3);
  int nd = rh_lua_checksizes(L, 4, size);
  if (rh_shape_numel(nd, size, &numel) || (uint64_t)numel > r->size / rh_dtype_size(dt) + 1)
    check_read(L, r, RH_ETRUNCATED, off, r->size + 1);
  read_opts_t ro = read_opts(L, 5);
  uint64_t n = (uint64_t)numel * rh_dtype_size(dt);
  if (off > r->size || n > r->size - off) check_read(L, r, RH_ETRUNCATED, off, n);
  rh_tensor_t *t = NULL;
  if (ro.map && !ro.swap && rh_afile_map_tensor(r->fd, off, dt, nd, size, &t) == 0) {
    if (ro.want_crc) ro.crc = (uint32_t)crc32_z(ro.crc, rh_tensor_data(t), (size_t)n);
    rh_lua_pushtensor(L, t);
  } else {
    t = rh_tensor_empty(dt, nd, size);
    if (!t) return raise_line(L, "%s: %s", r->who, rh_tensor_errmsg());
    rh_lua_pushtensor(L, t); /* (Lua's from here: an error below frees it) */
    fill(L, r, off, t, &ro);
  }
  if (!ro.want_crc) return 1;
  lua_pushnumber(L, (double)ro.crc);
  return 2;
}

static int l_reader_close(lua_State *L) {
  lreader_t *r = luaL_checkudata(L, 1, READER_MT);
  if (r->fd >= 0) close(r->fd);
  r->fd = -1;
  return 0;
}

static int l_reader_gc(lua_State *L) {
  l_reader_close(L);
  lreader_t *r = luaL_checkudata(L, 1, READER_MT);
  free(r->path);
  r->path = NULL;
  return 0;
}

/* af_crc32(s[, crc]) -> zlib's crc32 of s, continuing crc */
static int l_crc32(lua_State *L) {
  size_t n;
  const char *s = luaL_checklstring(L, 1, &n);
  uint32_t crc = (uint32_t)luaL_optnumber(L, 2, 0);
  lua_pushnumber(L, (double)crc32_z(crc, (const unsigned char *)s, n));
  return 1;
}

int rh_open_atomic_file(lua_State *L) {
  static const luaL_Reg file_methods[] = {
      {"write", l_write},   {"write_at", l_write_at}, {"write_tensor", l_write_tensor}, {"offset", l_offset},
      {"commit", l_commit}, {"abort", l_abort},       {"temp_path", l_temp_path},       {NULL, NULL}};
  static const luaL_Reg reader_methods[] = {{"size", l_size},           {"read", l_read},
                                            {"read_into", l_read_into}, {"read_tensor", l_read_tensor},
                                            {"close", l_reader_close},  {NULL, NULL}};
  rh_lua_class(L, FILE_MT, file_methods, l_file_gc, l_file_tostring);
  rh_lua_class(L, READER_MT, reader_methods, l_reader_gc, NULL);
  static const luaL_Reg fns[] = {{"af_open", l_open}, {"af_reader", l_reader}, {"af_crc32", l_crc32}, {NULL, NULL}};
  lua_newtable(L);
  luaL_register(L, NULL, fns);
  return 1;
}

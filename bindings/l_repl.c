/* l_repl.c: line input for the REPL that never blocks the loop. On a terminal,
 * libedit's readline emulation gives line editing, history and completion, fed a
 * character at a time when stdin is readable (uv_poll); elsewhere stdin is read
 * as a pipe and split into lines. Either way each line reaches Lua through one
 * callback, and EOF as nil. */
#include <editline/readline.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "rh_lua.h"

typedef struct {
  int active, tty, file;
  uv_poll_t poll;
  uv_pipe_t pipe;
  uv_idle_t idle; /* stdin is a regular file: lines are handed out from the loop */
  char *fbuf;
  size_t flen, foff;
  int ref_line, ref_complete;
  char *partial;
  size_t plen;
} repl_t;

static repl_t R = {0};

static void deliver(const char *line, size_t len) {
  lua_State *L = rh_ctx()->L;
  rh_pushref(L, R.ref_line);
  if (line) lua_pushlstring(L, line, len);
  else lua_pushnil(L);
  rh_callback(1, 0);
}

static void on_rl_line(char *line) {
  if (line && *line) add_history(line);
  deliver(line, line ? strlen(line) : 0);
  free(line);
}

static void poll_cb(uv_poll_t *h, int status, int events) {
  (void)h;
  (void)events;
  if (status < 0) {
    deliver(NULL, 0);
    return;
  }
  rl_callback_read_char();
}

static void alloc_cb(uv_handle_t *h, size_t suggested, uv_buf_t *buf) {
  (void)h;
  buf->base = malloc(suggested);
  buf->len = buf->base ? suggested : 0;
}

static void read_cb(uv_stream_t *s, ssize_t n, const uv_buf_t *buf) {
  (void)s;
  if (n > 0) {
    char *p = realloc(R.partial, R.plen + (size_t)n);
    if (p) {
      R.partial = p;
      memcpy(R.partial + R.plen, buf->base, (size_t)n);
      R.plen += (size_t)n;
      size_t start = 0;
      for (size_t i = 0; i < R.plen; i++)
        if (R.partial[i] == '\n') {
          deliver(R.partial + start, i - start);
          start = i + 1;
        }
      memmove(R.partial, R.partial + start, R.plen - start);
      R.plen -= start;
    }
  }
  free(buf->base);
  if (n < 0) {
    if (R.plen > 0) deliver(R.partial, R.plen);
    R.plen = 0;
    deliver(NULL, 0);
  }
}

static void idle_cb(uv_idle_t *h) {
  if (R.foff >= R.flen) {
    uv_idle_stop(h);
    deliver(NULL, 0);
    return;
  }
  char *nl = memchr(R.fbuf + R.foff, '\n', R.flen - R.foff);
  size_t end = nl ? (size_t)(nl - R.fbuf) : R.flen;
  size_t start = R.foff;
  R.foff = nl ? end + 1 : R.flen;
  deliver(R.fbuf + start, end - start);
}

/* completion: Lua returns a list of candidates for the word at point */
static char **completions;
static int ncompl, icompl;

static char *next_completion(const char *text, int state) {
  (void)text;
  if (state == 0) icompl = 0;
  if (icompl < ncompl) return strdup(completions[icompl++]);
  return NULL;
}

static char **complete(const char *text, int start, int end) {
  (void)start;
  (void)end;
  lua_State *L = rh_ctx()->L;
  for (int i = 0; i < ncompl; i++) free(completions[i]);
  free(completions);
  completions = NULL;
  ncompl = 0;
  if (R.ref_complete == LUA_NOREF) return NULL;
  rh_pushref(L, R.ref_complete);
  lua_pushstring(L, text);
  if (rh_callback(1, 1) != 0) return NULL;
  if (lua_istable(L, -1)) {
    int n = (int)lua_objlen(L, -1);
    completions = calloc((size_t)n + 1, sizeof(char *));
    for (int i = 1; completions && i <= n; i++) {
      lua_rawgeti(L, -1, i);
      const char *s = lua_tostring(L, -1);
      if (s) completions[ncompl++] = strdup(s);
      lua_pop(L, 1);
    }
  }
  lua_pop(L, 1);
  rl_attempted_completion_over = 1;
  if (ncompl == 0) return NULL;
  return rl_completion_matches(text, next_completion);
}

/* repl_start(prompt, on_line, complete, history_file) -> is_tty */
static int l_start(lua_State *L) {
  const char *prompt = luaL_checkstring(L, 1);
  luaL_checktype(L, 2, LUA_TFUNCTION);
  if (R.active) return luaL_error(L, "the REPL input is already started");
  memset(&R, 0, sizeof R);
  lua_pushvalue(L, 2);
  R.ref_line = luaL_ref(L, LUA_REGISTRYINDEX);
  R.ref_complete = LUA_NOREF;
  if (lua_isfunction(L, 3)) {
    lua_pushvalue(L, 3);
    R.ref_complete = luaL_ref(L, LUA_REGISTRYINDEX);
  }
  R.tty = isatty(0);
  R.active = 1;
  if (R.tty) {
    const char *hist = luaL_optstring(L, 4, NULL);
    if (hist) read_history(hist);
    rl_attempted_completion_function = complete;
    /* our own SIGINT watcher handles Ctrl-C; libedit's handler would re-raise it
     * to the whole process group (the terminal's shell included) */
    rl_catch_signals = 0;
    rl_callback_handler_install(prompt, on_rl_line);
    uv_poll_init(rh_ctx()->loop, &R.poll, 0);
    uv_poll_start(&R.poll, UV_READABLE, poll_cb);
  } else if (uv_guess_handle(0) == UV_NAMED_PIPE) {
    uv_pipe_init(rh_ctx()->loop, &R.pipe, 0);
    uv_pipe_open(&R.pipe, 0);
    uv_read_start((uv_stream_t *)&R.pipe, alloc_cb, read_cb);
  } else {
    /* a file (or anything that cannot be polled): read it all, hand out lines */
    R.file = 1;
    size_t cap = 0;
    for (;;) {
      if (R.flen + 4096 > cap) {
        cap = cap ? cap * 2 : 65536;
        char *nb = realloc(R.fbuf, cap);
        if (!nb) break;
        R.fbuf = nb;
      }
      ssize_t n = read(0, R.fbuf + R.flen, cap - R.flen);
      if (n <= 0) break;
      R.flen += (size_t)n;
    }
    uv_idle_init(rh_ctx()->loop, &R.idle);
    uv_idle_start(&R.idle, idle_cb);
  }
  lua_pushboolean(L, R.tty);
  return 1;
}

/* the prompt of the next line (a continuation's ">> "). On a terminal the line
 * editor starts the next line over with it: rl_set_prompt alone, called after
 * libedit began that line, made it draw the line once as typed and again under
 * the new prompt when Enter came (every continuation line shown twice). */
static int l_prompt(lua_State *L) {
  const char *prompt = luaL_checkstring(L, 1);
  if (R.active && R.tty) {
    rl_callback_handler_remove();
    rl_callback_handler_install(prompt, on_rl_line);
  } else if (R.active) {
    fputs(prompt, stdout);
    fflush(stdout);
  }
  return 0;
}

/* drop the line being edited and start over with a fresh prompt (Ctrl-C) */
static int l_reset(lua_State *L) {
  const char *prompt = luaL_checkstring(L, 1);
  if (R.active && R.tty) {
    rl_callback_handler_remove();
    rl_callback_handler_install(prompt, on_rl_line);
  }
  return 0;
}

/* a fresh prompt on a new line (after output or Ctrl-C) */
static int l_redisplay(lua_State *L) {
  (void)L;
  if (R.active && R.tty) {
    rl_on_new_line();
    rl_redisplay();
  }
  return 0;
}

static int l_stop(lua_State *L) {
  const char *hist = luaL_optstring(L, 1, NULL);
  if (!R.active) return 0;
  R.active = 0;
  if (R.tty) {
    if (hist) write_history(hist);
    rl_callback_handler_remove();
    uv_poll_stop(&R.poll);
    uv_close((uv_handle_t *)&R.poll, NULL);
  } else if (R.file) {
    uv_idle_stop(&R.idle);
    uv_close((uv_handle_t *)&R.idle, NULL);
    free(R.fbuf);
    R.fbuf = NULL;
  } else {
    uv_read_stop((uv_stream_t *)&R.pipe);
    uv_close((uv_handle_t *)&R.pipe, NULL);
  }
  free(R.partial);
  R.partial = NULL;
  rh_unref(L, &R.ref_line);
  rh_unref(L, &R.ref_complete);
  return 0;
}

int rh_open_repl(lua_State *L) {
  static const luaL_Reg fns[] = {{"repl_start", l_start}, {"repl_prompt", l_prompt}, {"repl_redisplay", l_redisplay},
                                 {"repl_reset", l_reset}, {"repl_stop", l_stop},     {NULL, NULL}};
  lua_newtable(L);
  luaL_register(L, NULL, fns);
  return 1;
}

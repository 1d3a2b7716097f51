/* main.c: the rpchost executable's entry point. All command-line handling lives in
 * the Lua front end (lua/rpchost/cli.lua) started by the binding layer. */
int rh_lua_main(int argc, char **argv);

int main(int argc, char **argv) { return rh_lua_main(argc, argv); }

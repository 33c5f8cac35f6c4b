"""What crosses Redis: wire types, limits, key names, and the Lua scripts with their typed bindings."""

-- luacheck's settings for the shard scripts, checked as Redis runs them:
-- each script composed with the libraries it uses (see scripts.rs,
-- `Scripts::sources`). A library's helpers are unused by most scripts,
-- so unused names are not reported; every other warning is.
std = "lua51"
read_globals = { "redis", "KEYS", "ARGV", "cjson", "cmsgpack", "bit", "struct" }
max_line_length = false
unused = false

"""The command line beside `argosy serve`: list, ps, show, stop, run, sessions, bench.

Each command talks to a running server over HTTP (`--host` / `--port`, or ARGOSY_HOST as
`host:port`) except `list` (the packaged models, read locally, plus a server's when one
answers) and `sessions` (the session store in `--data-dir`, read directly).
"""

"""`python -m argosy serve ...`"""

from argosy.cli import main

raise SystemExit(main())

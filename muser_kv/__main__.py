"""``python -m muser_kv``: the ``muser-kv`` command."""

import sys

from .cli import main

sys.exit(main())

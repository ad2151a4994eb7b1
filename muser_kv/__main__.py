"""``python -m muser_kv``: the ``muser-kv`` command."""

import sys

from muser_kv.serving.cli import main

sys.exit(main())

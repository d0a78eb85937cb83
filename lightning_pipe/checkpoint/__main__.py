"""``python -m lightning_pipe.checkpoint consolidate|shard|info ...``"""

import sys

from lightning_pipe.checkpoint.format import main

sys.exit(main())

import sys

from bench.gpu.driver import main

sys.exit(main())

"""``python -m lightning_pipe.trace plot|chrome|summary records.json ...``"""

from lightning_pipe.trace.export import main

main()

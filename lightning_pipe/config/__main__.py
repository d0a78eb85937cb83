"""``python -m lightning_pipe.config --markdown``: print docs/settings.md."""

import argparse

from lightning_pipe.config.markdown import settings_markdown

parser = argparse.ArgumentParser(prog="python -m lightning_pipe.config", description=__doc__)
parser.add_argument("--markdown", action="store_true", help="print docs/settings.md")
if parser.parse_args().markdown:
    print(settings_markdown(), end="")
else:
    parser.print_help()

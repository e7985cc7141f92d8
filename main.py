"""Train the speedrun GPT: ``python main.py fit --config configs/quickstart.yaml``.

Same command line as the ``nanogpt-pl`` console script (see ``nanogpt_pl/cli.py``).
"""

import sys

from nanogpt_pl.cli import main

if __name__ == "__main__":
    sys.exit(main())

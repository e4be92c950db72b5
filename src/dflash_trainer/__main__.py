import sys

from dflash_trainer.cli import main

sys.exit(main())

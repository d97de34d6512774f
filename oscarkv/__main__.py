import sys

from oscarkv.cli import main

sys.exit(main())

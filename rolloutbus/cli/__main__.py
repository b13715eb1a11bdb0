import sys

from rolloutbus.cli import main

sys.exit(main())

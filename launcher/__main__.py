import sys

from pshard.launcher.launch import main

if __name__ == "__main__":
    sys.exit(main())

import pathlib
import sys

# The positional reference lives next to the tests that use it.
sys.path.insert(0, str(pathlib.Path(__file__).parent))

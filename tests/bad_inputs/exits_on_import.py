"""Bad input: the model file calls sys.exit() when imported (a script, not a model file)."""
import sys

sys.exit(3)

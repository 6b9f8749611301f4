"""Bad input: the factory calls exit() (e.g. an argparse script's main)."""
import sys


def build():
    sys.exit("usage: train.py --config FILE")

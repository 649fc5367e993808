"""Tokenize text files into an hpc_train indexed dataset (same as `hpc-train prepare-data`)."""

import sys

from hpc_train.cli import main

if __name__ == "__main__":
    main(["prepare-data", *sys.argv[1:]])

"""Bodies of the `hpc-train` commands that stand on the whole stack (the builder included): Hugging Face
import and export (convert.py), `generate` and `doctor`. cli.py parses the arguments and calls them."""

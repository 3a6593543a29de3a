"""Executes one section of a notebook in place: its set-up cell (the first code cell), then every cell from
the markdown heading that contains TEXT to the end. The other cells keep the outputs they have.

For a section added to a notebook whose other cells take long (e.g. 04_compression.ipynb's overlap rows):

    NOLOCO_SEEDS=0 python experiments/ablations/execute_cells.py experiments/ablations/04_compression.ipynb "Streaming overlap"
"""

import argparse
import os
import sys

import nbclient
import nbformat


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("notebook")
  parser.add_argument("heading", help="text of the markdown heading where the section starts")
  parser.add_argument("--kernel", default="python3")
  args = parser.parse_args(argv)
  book = nbformat.read(args.notebook, as_version=4)
  code = [i for i, c in enumerate(book.cells) if c.cell_type == "code"]
  start = next((i for i, c in enumerate(book.cells) if c.cell_type == "markdown" and c.source.startswith("#")
                and args.heading in c.source.splitlines()[0]), None)
  if start is None:
    raise SystemExit(f"{args.notebook}: no markdown heading contains {args.heading!r}")
  chosen = [code[0]] + [i for i in code if i > start]
  client = nbclient.NotebookClient(book, timeout=None, kernel_name=args.kernel,
                                   resources={"metadata": {"path": os.path.dirname(os.path.abspath(args.notebook))}})
  with client.setup_kernel():
    for i in chosen:
      print(f"executing cell {i}", file=sys.stderr, flush=True)
      client.execute_cell(book.cells[i], i)
  nbformat.write(book, args.notebook)


if __name__ == "__main__":
  main()

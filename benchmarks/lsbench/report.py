"""What a benchmark run prints: lines, targets with verdicts, and tables.

Sections print through one `Report`. A target prints its value, its limit and
whether it holds, and is kept for the summary; a table prints as aligned text
where it is measured and is kept, so that the runner can print every table
again in Markdown at the end (what docs/guides/performance.md shows).
"""

import sys


class Table:
    """Rows of strings under a title and column headings."""

    def __init__(self, title, columns):
        self.title = title
        self.columns = list(columns)
        self.rows = []

    def add(self, *cells):
        if len(cells) != len(self.columns):
            raise ValueError(f"table {self.title!r} has {len(self.columns)} "
                             f"columns, got a row of {len(cells)}")
        self.rows.append([str(cell) for cell in cells])

    def text(self, indent="  "):
        widths = [max(len(row[i]) for row in [self.columns] + self.rows)
                  for i in range(len(self.columns))]
        lines = [indent + "  ".join(cell.ljust(width) for cell, width
                                    in zip(row, widths)).rstrip()
                 for row in [self.columns] + self.rows]
        return "\n".join(lines)

    def markdown(self):
        lines = ["| " + " | ".join(self.columns) + " |",
                 "|" + "---|" * len(self.columns)]
        lines += ["| " + " | ".join(row) + " |" for row in self.rows]
        return "\n".join(lines)


class Report:
    """Collects target verdicts and tables while printing."""

    def __init__(self, out=None):
        self.out = out or sys.stdout
        self.verdicts = []  # [(description, holds)]
        self.tables = []
        self.results = {}  # Section name -> what its `run` returned.

    def line(self, text=""):
        print(text, file=self.out, flush=True)

    def target(self, description, value, limit, higher_is_better=False):
        """Prints and keeps whether `value` is within `limit`; returns it."""
        holds = value >= limit if higher_is_better else value <= limit
        self.verdicts.append((description, holds))
        relation = ">=" if higher_is_better else "<="
        self.line(f"    target {description}: {value:.3f} {relation} "
                  f"{limit:.3f} -> {'HOLDS' if holds else 'MISSED'}")
        return holds

    def table(self, title, columns):
        """A new table, printed by `show` and again in the summary."""
        table = Table(title, columns)
        self.tables.append(table)
        return table

    def shared_table(self, title, columns):
        """The table of that title, made on first use: several sections
        add rows to it (the cost per feature)."""
        for table in self.tables:
            if table.title == title:
                return table
        return self.table(title, columns)

    def show(self, table):
        self.line(f"\n  {table.title}")
        self.line(table.text())

    def summary(self):
        """The verdicts, then every table in Markdown."""
        held = sum(holds for _, holds in self.verdicts)
        self.line(f"\nTargets holding: {held} of {len(self.verdicts)}")
        for description, holds in self.verdicts:
            self.line(f"  [{'x' if holds else ' '}] {description}")
        self.line("\nThe tables in Markdown (for docs/guides/performance.md):")
        for table in self.tables:
            self.line(f"\n**{table.title}**\n")
            self.line(table.markdown())


def verdict(holds):
    return "✓" if holds else "✗"

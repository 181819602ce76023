"""Builds ``kjv_chapters.jsonl.gz``, the retrieval benchmark's corpus (kjv.md says how).

Input: the King James Bible as the Debian ``bible`` program prints it
(chapter headings ``Genesis 1``, verses ``  1 In the beginning ...`` wrapped
over lines). Output: one JSON object per chapter, gzip-compressed::

    {"id": "Genesis 1", "book": "Genesis", "chapter": 1, "testament": "old",
     "text": "In the beginning God created the heaven and the earth. And ..."}

Usage: ``python benchmarks/data/make_kjv_corpus.py kjv.txt benchmarks/data/kjv_chapters.jsonl.gz``
"""

from __future__ import annotations

import gzip
import json
import re
import sys
from pathlib import Path

HEADING = re.compile(r"^([1-3]?\s?[A-Z][A-Za-z ]+?) (\d+)$")
VERSE = re.compile(r"^\s+(\d+) (.*)$")
#: The first book of the New Testament (the 40th).
FIRST_NEW_BOOK = "Matthew"


def chapters(text: str) -> list[dict[str, object]]:
    """The chapters of the ``bible`` program's output, verses joined by spaces."""
    found: list[dict[str, object]] = []
    verses: list[str] = []
    testament = "old"
    for line in text.splitlines():
        heading = HEADING.match(line)
        if heading:
            book, chapter = heading.group(1), int(heading.group(2))
            testament = "new" if book == FIRST_NEW_BOOK or testament == "new" else "old"
            verses = []
            found.append({"id": f"{book} {chapter}", "book": book, "chapter": chapter,
                          "testament": testament, "verses": verses})
        elif (verse := VERSE.match(line)) is not None:
            verses.append(verse.group(2))
        elif line.strip():
            verses[-1] += " " + line.strip()
    for chapter in found:
        chapter["text"] = " ".join(chapter.pop("verses"))  # type: ignore[arg-type]
    return found


def main(source: str, target: str) -> None:
    rows = chapters(Path(source).read_text())
    with gzip.open(target, "wt", compresslevel=9) as out:
        for row in rows:
            out.write(json.dumps(row) + "\n")
    print(f"{len(rows)} chapters -> {target}")


if __name__ == "__main__":
    main(*sys.argv[1:3])

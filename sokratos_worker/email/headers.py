"""How a header reads as text: raw 8-bit bytes and RFC 2047 encoded words decoded, in the
declared charset (or UTF-8 with replacement), and the older decoding that processed_emails
keys keep.
"""

from __future__ import annotations

import codecs
import email.header
import re
from email.message import Message

# An RFC 2047 encoded word, as email.header matches it; the group keeps it in re.split.
_ENCODED_WORD = re.compile(r"(=\?[^?]*\?[qQbB]\?.*?\?=)")


# Charset labels mailers send (IANA and WHATWG names) that Python's codecs do not know, and
# the codec that reads them: Hebrew from Thunderbird and Outlook, Thai from Outlook, Japanese.
_CODECS_BY_LABEL = {
    "iso-8859-8-i": "iso-8859-8",  # logical order: the same bytes as ISO-8859-8
    "iso-8859-8-e": "iso-8859-8",
    "csiso88598i": "iso-8859-8",
    "csiso88598e": "iso-8859-8",
    "iso-8859-6-i": "iso-8859-6",
    "iso-8859-6-e": "iso-8859-6",
    "csiso88596i": "iso-8859-6",
    "csiso88596e": "iso-8859-6",
    "windows-874": "cp874",
    "windows-31j": "cp932",
    "cswindows31j": "cp932",
    "x-sjis": "cp932",
    "ks_c_5601-1989": "cp949",
    "gb_2312-80": "gb18030",
    "csgb2312": "gb18030",
    "csiso58gb231280": "gb18030",
    "x-gbk": "gb18030",
    "x-euc-jp": "euc_jp",
    "x-x-big5": "big5",
    "x-mac-roman": "mac_roman",
    "x-mac-cyrillic": "mac_cyrillic",
    "x-mac-greek": "mac_greek",
    "x-mac-ce": "mac_latin2",
    "x-cp1250": "cp1250",
    "x-cp1251": "cp1251",
    "x-cp1252": "cp1252",
}


# Codecs read as mail clients read them (the WHATWG Encoding Standard), whatever alias names
# them: the vendor supersets the mail was written in, whose extra characters (①, 똠, 镕, the
# curly quotes of "Latin-1" from Windows) came out as replacement or control characters.
_ASCII_OR_UTF8 = "ascii-or-utf-8"
_SUPERSETS = {
    "shift_jis": "cp932",
    "euc_kr": "cp949",
    "gb2312": "gb18030",
    "gbk": "gb18030",
    "iso8859-1": "cp1252",
    "ascii": _ASCII_OR_UTF8,
}


def _codec_name(name: str) -> str:
    """Python's own name of the codec ``name`` is an alias of (``l1``: ``iso8859-1``)."""
    try:
        return codecs.lookup(name).name
    except (LookupError, ValueError):  # (unknown, or a name with NUL: decode_bytes says so)
        return name


def decode_bytes(data: bytes, charset: str | None, notes: list[str], *, labels: bool = True) -> str:
    """Decode with the declared charset; an unusable one falls back to UTF-8 with replacement.

    ``labels=False`` leaves out the labels of _CODECS_BY_LABEL, as the worker did before it
    knew them: for processed_emails keys only (:func:`legacy_decode_header`)."""
    name = (charset or "utf-8").strip().strip('"').lower() or "utf-8"
    if labels:
        name = _CODECS_BY_LABEL.get(name, name)
        name = _SUPERSETS.get(_codec_name(name), name)
        if name == _ASCII_OR_UTF8:  # 8-bit bytes in "ASCII": UTF-8 when they are
            try:
                return data.decode("utf-8")
            except UnicodeDecodeError:
                name = "cp1252"
    try:
        return data.decode(name, errors="replace")
    except LookupError:
        notes.append(f"unknown charset {name!r}: decoded as UTF-8 with replacement characters")
    # Codecs that are not text encodings (idna, punycode, undefined) or a name with NUL.
    except (UnicodeError, ValueError) as exc:
        notes.append(
            f"charset {name!r} cannot decode text ({type(exc).__name__}):"
            " decoded as UTF-8 with replacement characters"
        )
    return data.decode("utf-8", errors="replace")


def _unescape(text: str, notes: list[str]) -> str:
    """Raw 8-bit header bytes (RFC 6532), which the email package keeps as surrogates, as UTF-8."""
    if text.isascii():
        return text
    try:
        data = text.encode("utf-8", errors="surrogateescape")
    except UnicodeEncodeError:  # not escaped bytes: parse._clean replaces what is left
        return text
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        notes.append("8-bit header that is not UTF-8: decoded with replacement characters")
        return data.decode("utf-8", errors="replace")


def _word_bytes(word: str) -> tuple[bytes, str | None] | None:
    """One RFC 2047 encoded word's bytes and charset; None when it is malformed."""
    try:
        pieces = email.header.decode_header(word)
    except Exception:  # bad base64 and the like: the caller shows the word as it came
        return None
    if len(pieces) != 1 or not isinstance(pieces[0][0], bytes):
        return None
    data, charset = pieces[0]
    # An RFC 2231 language suffix ("utf-8*en") names no codec.
    return data, charset.partition("*")[0] if charset else None


class _WordRun:
    """Adjacent encoded words of one charset, decoded together: a mailer may split one
    multi-byte character across two words, which decoded one by one give U+FFFD twice."""

    def __init__(self, notes: list[str]) -> None:
        self.notes = notes
        self.out: list[str] = []
        # The run's words, joined once at flush: appending to one bytes object copies the
        # whole run for each word, quadratic (a 9 MB Subject of encoded words took 20 s).
        self._data: list[bytes] = []
        self._charset: str | None = None

    def add(self, data: bytes, charset: str | None) -> None:
        """Append one word's bytes, decoding the run before it when its charset differs."""
        if self._data and charset != self._charset:
            self.flush()
        self._data.append(data)
        self._charset = charset

    def text(self, text: str) -> None:
        """Append text that is not an encoded word, after the run before it."""
        self.flush()
        self.out.append(text)

    def flush(self) -> None:
        """Decode the pending run."""
        if self._data:
            self.out.append(decode_bytes(b"".join(self._data), self._charset, self.notes))
        self._data, self._charset = [], None


def decode_header(value: str, notes: list[str]) -> str:
    """A header value as text, unfolded: raw 8-bit bytes read as UTF-8, encoded words decoded.

    The text around encoded words is kept as it is, rather than passed through
    ``email.header.decode_header``, which would turn its non-ASCII characters into escapes;
    adjacent encoded words of one charset are joined before decoding, as it does.
    """
    unfolded = re.sub(r"\r?\n[ \t]+", " ", _unescape(value, notes)).strip()
    chunks = _ENCODED_WORD.split(unfolded)
    run = _WordRun(notes)
    for index, chunk in enumerate(chunks):
        if index % 2:
            word = _word_bytes(chunk)
            if word is None:
                run.text(chunk)
            else:
                run.add(*word)
        elif not (chunk.isspace() and 0 < index < len(chunks) - 1) and chunk:
            # Whitespace between two encoded words is not part of the text (RFC 2047 §6.2).
            run.text(chunk)
    run.flush()
    return "".join(run.out).strip()


def _decode_word(word: str, notes: list[str]) -> str:
    """One RFC 2047 encoded word decoded alone; a malformed one keeps its raw form."""
    try:
        pieces = email.header.decode_header(word)
    except Exception:  # bad base64 and the like: keep the word as it came
        return word
    return "".join(
        decode_bytes(data, charset, notes, labels=False) if isinstance(data, bytes) else data
        for data, charset in pieces
    )


def legacy_decode_header(value: str) -> str:
    """A header value decoded as the worker did before adjacent encoded words were joined.

    For processed_emails keys only (:func:`message_key`): a mail without Message-ID is keyed
    by the hash of its decoded Date, From and Subject, and a character split across two
    encoded words decodes differently word by word ("caf\ufffd\ufffd") than joined ("café").
    Keys made with the better decoder would differ from those already recorded, and a
    re-read of the mailbox (reused UIDs, a UIDVALIDITY change) would triage such mail again.
    So keys keep this decoding, whatever the text shown to triage becomes.
    """
    notes: list[str] = []  # what is wrong with the header is noted by decode_header
    unfolded = re.sub(r"\r?\n[ \t]+", " ", _unescape(value, notes)).strip()
    chunks = _ENCODED_WORD.split(unfolded)
    out: list[str] = []
    for index, chunk in enumerate(chunks):
        if index % 2:
            out.append(_decode_word(chunk, notes))
        elif not (chunk.isspace() and 0 < index < len(chunks) - 1):
            out.append(chunk)
    return "".join(out).strip()


def raw_values(msg: Message, name: str) -> tuple[str, ...]:
    """The raw values of one header, as :func:`header` reads them."""
    wanted = name.lower()
    return tuple(str(value) for key, value in msg.raw_items() if key.lower() == wanted)


def header(msg: Message, name: str, notes: list[str]) -> str:
    """All values of one header, decoded and joined; read raw so parsing cannot raise."""
    wanted = name.lower()
    values = [
        decode_header(str(value), notes) for key, value in msg.raw_items() if key.lower() == wanted
    ]
    return ", ".join(v for v in values if v)

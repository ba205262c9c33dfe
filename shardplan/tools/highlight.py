"""A Pygments lexer for `.splan` files, registered as the `splan` lexer through an entry point
(``pygments.lexers``), so ```` ```splan ```` blocks highlight in Sphinx, MkDocs and
``pygmentize -l splan``. Its token rules follow grammar/splan.lark; a test lexes every plan in
plans/ and every example in docs/language.md and finds no error token.
"""

from __future__ import annotations

from pygments.lexer import RegexLexer, bygroups, words
from pygments.token import Comment, Error, Keyword, Name, Number, Operator, Punctuation, String, Whitespace

__all__ = ["SplanLexer"]

STATEMENTS = ("plan", "extends", "mesh", "backend", "batch", "input", "param", "opt", "act", "axis", "default", "cache")


class SplanLexer(RegexLexer):
    """Sharding plans (shardplan's `.splan` language)."""

    name = "splan"
    aliases = ["splan", "shardplan"]
    filenames = ["*.splan"]
    mimetypes = ["text/x-splan"]
    url = "https://github.com/shardplan/shardplan"

    tokens = {
        "root": [
            (r"\s+", Whitespace),
            (r"#[^\n]*", Comment.Single),
            (words(STATEMENTS, suffix=r"\b"), Keyword),
            (r"replicated\b", Keyword.Constant),
            (r'"[^"\n]*"', String),
            (r"(@)(ici|dcn|[A-Za-z_][A-Za-z0-9_]*)\b", bygroups(Operator, Name.Attribute)),
            (r"(:)(\s*)(explicit|auto)\b", bygroups(Operator, Whitespace, Keyword.Type)),  # an axis's type
            (r"(?<=mesh)(\s+)(explicit|auto)\b", bygroups(Whitespace, Keyword.Type)),  # every axis's type
            (r"\.\.\.", Keyword.Pseudo),
            (r"\b_\b", Keyword.Pseudo),
            (r"->|=|\*", Operator),
            (r"[(),]", Punctuation),
            (r"[0-9]+", Number.Integer),
            (r"[A-Za-z_][A-Za-z0-9_]*", Name.Variable),
            (r".", Error),  # nothing else is in the language
        ]
    }

//! A small Rust token scanner for the tidy checks: identifiers and punctuation with line numbers,
//! comments kept aside, string and character literals skipped.
//!
//! It is not a Rust parser and does not try to be one. It knows exactly enough of the lexical
//! grammar to tell code from prose:
//! - `//` and (nested) `/* */` comments are not code; their text is kept in [`Scan::comments`]
//!   so a check can look for a `// SAFETY:` line;
//! - string literals (`"…"`, `b"…"`, `c"…"`, raw `r#"…"#` with any number of `#`) and character
//!   literals (`'a'`, `'\n'`, `'\u{1F600}'`) are skipped, so `"unsafe"` is never a keyword;
//! - a lifetime or label (`'a`, `'outer`) is skipped as a whole;
//! - `r#unsafe` is a raw identifier, reported with `raw: true` so it is never taken for the
//!   keyword;
//! - number literals (`0x1F`, `1u8`, `2.5e3`) are skipped.
//!
//! Invariants of the output: tokens and comments are in source order; every line number is
//! 1-based and points at the line where the token or comment starts.

/// One token of code.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Token {
    /// An identifier or keyword (`unsafe`, `forbid`, `CpuRouter`); `raw` for `r#name`.
    Ident {
        text: String,
        raw: bool,
        line: usize,
    },
    /// A single punctuation character (`#`, `!`, `[`, `{`, `:`).
    Punct { ch: char, line: usize },
}

impl Token {
    /// The line the token starts on (1-based).
    pub fn line(&self) -> usize {
        match self {
            Token::Ident { line, .. } | Token::Punct { line, .. } => *line,
        }
    }

    /// True when this token is the identifier (or keyword) `word`, written without `r#`.
    pub fn is_word(&self, word: &str) -> bool {
        matches!(self, Token::Ident { text, raw: false, .. } if text == word)
    }

    /// True when this token is the punctuation character `ch`.
    pub fn is_punct(&self, ch: char) -> bool {
        matches!(self, Token::Punct { ch: c, .. } if *c == ch)
    }
}

/// A comment: the line it starts on and its full text, delimiters included.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Comment {
    /// The line the comment starts on (1-based).
    pub line: usize,
    /// The comment's text, from `//` or `/*` to the end of the line or the closing `*/`.
    pub text: String,
}

/// The result of scanning one file.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Scan {
    /// Code tokens, in source order.
    pub tokens: Vec<Token>,
    /// Comments (line, block and doc comments), in source order.
    pub comments: Vec<Comment>,
}

/// Scans `source` into code tokens and comments. Never fails: an unterminated literal or comment
/// simply runs to the end of the file (the compiler reports those; tidy does not have to).
pub fn scan(source: &str) -> Scan {
    let chars: Vec<char> = source.chars().collect();
    let mut scanner = Scanner {
        chars: &chars,
        pos: 0,
        line: 1,
        out: Scan::default(),
    };
    scanner.run();
    scanner.out
}

struct Scanner<'a> {
    chars: &'a [char],
    pos: usize,
    line: usize,
    out: Scan,
}

impl Scanner<'_> {
    fn peek(&self, ahead: usize) -> Option<char> {
        self.chars.get(self.pos + ahead).copied()
    }

    /// Moves one character forward, counting lines.
    fn bump(&mut self) {
        if self.peek(0) == Some('\n') {
            self.line += 1;
        }
        self.pos += 1;
    }

    fn run(&mut self) {
        while let Some(c) = self.peek(0) {
            if let Some((prefix, raw)) = self.string_prefix_len() {
                for _ in 0..prefix {
                    self.bump();
                }
                if raw {
                    self.raw_string();
                } else if self.peek(0) == Some('\'') {
                    self.quote();
                } else {
                    self.quoted_string();
                }
                continue;
            }
            match c {
                '/' if self.peek(1) == Some('/') => self.line_comment(),
                '/' if self.peek(1) == Some('*') => self.block_comment(),
                '"' => self.quoted_string(),
                '\'' => self.quote(),
                'r' if self.peek(1) == Some('#') && self.peek(2).is_some_and(is_ident_start) => {
                    self.bump();
                    self.bump();
                    self.ident(true);
                }
                c if is_ident_start(c) => self.ident(false),
                c if c.is_ascii_digit() => self.number(),
                c if c.is_whitespace() => self.bump(),
                c => {
                    self.out.tokens.push(Token::Punct {
                        ch: c,
                        line: self.line,
                    });
                    self.bump();
                }
            }
        }
    }

    /// When the text at the cursor starts a prefixed literal (`b"`, `b'`, `c"`, `r"`, `r#"`,
    /// `br"`, `br#"`, `cr#"`), returns how many prefix characters to skip and whether the
    /// literal is raw. `r#ident` is not a literal and answers `None`.
    fn string_prefix_len(&self) -> Option<(usize, bool)> {
        let first = self.peek(0)?;
        let (letters, raw) = match (first, self.peek(1)) {
            ('b' | 'c', Some('r')) => (2, true),
            ('r', _) => (1, true),
            ('b', _) => (1, false),
            ('c', _) => (1, false),
            _ => return None,
        };
        // An identifier character before the prefix means it is the tail of a longer name.
        if self.pos > 0 && is_ident_continue(self.chars[self.pos - 1]) {
            return None;
        }
        if raw {
            let mut hashes = 0;
            while self.peek(letters + hashes) == Some('#') {
                hashes += 1;
            }
            (self.peek(letters + hashes) == Some('"')).then_some((letters, true))
        } else {
            let next = self.peek(letters)?;
            let literal = next == '"' || (first == 'b' && next == '\'');
            literal.then_some((letters, false))
        }
    }

    fn line_comment(&mut self) {
        let line = self.line;
        let start = self.pos;
        while self.peek(0).is_some_and(|c| c != '\n') {
            self.bump();
        }
        let text = self.chars[start..self.pos].iter().collect();
        self.out.comments.push(Comment { line, text });
    }

    fn block_comment(&mut self) {
        let line = self.line;
        let start = self.pos;
        self.bump();
        self.bump();
        let mut depth = 1;
        while depth > 0 {
            match (self.peek(0), self.peek(1)) {
                (None, _) => break,
                (Some('/'), Some('*')) => {
                    depth += 1;
                    self.bump();
                    self.bump();
                }
                (Some('*'), Some('/')) => {
                    depth -= 1;
                    self.bump();
                    self.bump();
                }
                _ => self.bump(),
            }
        }
        let text = self.chars[start..self.pos].iter().collect();
        self.out.comments.push(Comment { line, text });
    }

    /// Skips `"…"` with backslash escapes; the cursor is on the opening quote.
    fn quoted_string(&mut self) {
        self.bump();
        while let Some(c) = self.peek(0) {
            match c {
                '\\' => {
                    self.bump();
                    self.bump();
                }
                '"' => {
                    self.bump();
                    return;
                }
                _ => self.bump(),
            }
        }
    }

    /// Skips `#…#"…"#…#`; the cursor is on the first `#` or the quote.
    fn raw_string(&mut self) {
        let mut hashes = 0;
        while self.peek(0) == Some('#') {
            hashes += 1;
            self.bump();
        }
        self.bump(); // The opening quote.
        while let Some(c) = self.peek(0) {
            self.bump();
            if c == '"' && (0..hashes).all(|i| self.peek(i) == Some('#')) {
                for _ in 0..hashes {
                    self.bump();
                }
                return;
            }
        }
    }

    /// The cursor is on `'`: a character literal, a lifetime, or a label.
    fn quote(&mut self) {
        match (self.peek(1), self.peek(2)) {
            // `'\n'`, `'\''`, `'\u{…}'`: skip to the closing quote after the escape.
            (Some('\\'), _) => {
                self.bump();
                self.bump();
                self.bump();
                while self.peek(0).is_some_and(|c| c != '\'' && c != '\n') {
                    self.bump();
                }
                self.bump();
            }
            // `'x'`, including a quote character: one character between quotes.
            (Some(_), Some('\'')) => {
                self.bump();
                self.bump();
                self.bump();
            }
            // `'a`, `'static`, `'outer:`: a lifetime or label, not code we look at.
            (Some(c), _) if is_ident_start(c) => {
                self.bump();
                while self.peek(0).is_some_and(is_ident_continue) {
                    self.bump();
                }
            }
            _ => {
                self.out.tokens.push(Token::Punct {
                    ch: '\'',
                    line: self.line,
                });
                self.bump();
            }
        }
    }

    fn ident(&mut self, raw: bool) {
        let line = self.line;
        let start = self.pos;
        while self.peek(0).is_some_and(is_ident_continue) {
            self.bump();
        }
        let text = self.chars[start..self.pos].iter().collect();
        self.out.tokens.push(Token::Ident { text, raw, line });
    }

    fn number(&mut self) {
        while self.peek(0).is_some_and(is_ident_continue) {
            self.bump();
        }
    }
}

fn is_ident_start(c: char) -> bool {
    c == '_' || c.is_alphabetic()
}

fn is_ident_continue(c: char) -> bool {
    c == '_' || c.is_alphanumeric()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The identifiers of `source`, in order, `r#` written back for raw ones.
    fn idents(source: &str) -> Vec<String> {
        scan(source)
            .tokens
            .iter()
            .filter_map(|t| match t {
                Token::Ident {
                    text, raw: false, ..
                } => Some(text.clone()),
                Token::Ident {
                    text, raw: true, ..
                } => Some(format!("r#{text}")),
                Token::Punct { .. } => None,
            })
            .collect()
    }

    fn check(source: &str, expected: &[&str]) {
        assert_eq!(idents(source), expected, "source: {source:?}");
    }

    #[test]
    fn code_identifiers_are_tokens() {
        check("unsafe { f() }", &["unsafe", "f"]);
        check("#![forbid(unsafe_code)]", &["forbid", "unsafe_code"]);
        check("let x: u8 = 1u8 + 0x1F;", &["let", "x", "u8"]);
    }

    #[test]
    fn comments_are_not_code() {
        check("// unsafe here\nfn a() {}", &["fn", "a"]);
        check("/* unsafe /* nested unsafe */ still comment */ b", &["b"]);
        check("/// Doc with unsafe.\n//! Inner doc unsafe.\nc", &["c"]);
    }

    #[test]
    fn strings_are_not_code() {
        check(r#"let s = "unsafe \" unsafe"; t"#, &["let", "s", "t"]);
        check(
            r###"let s = r#"unsafe "quoted" unsafe"#; t"###,
            &["let", "s", "t"],
        );
        check(
            r#"let s = b"unsafe"; let c = c"unsafe"; t"#,
            &["let", "s", "let", "c", "t"],
        );
        check(r#"let s = br"unsafe"; t"#, &["let", "s", "t"]);
    }

    #[test]
    fn chars_and_lifetimes_are_not_identifiers() {
        check("let q = '\"'; unsafe_fn()", &["let", "q", "unsafe_fn"]);
        check("let q = '\\''; x", &["let", "q", "x"]);
        check("let q = '\\u{1F600}'; x", &["let", "q", "x"]);
        check(
            "fn f<'a>(x: &'a str) -> &'static str { 'outer: loop {} }",
            &["fn", "f", "x", "str", "str", "loop"],
        );
        check("let b = b'x'; y", &["let", "b", "y"]);
    }

    #[test]
    fn raw_identifiers_are_marked() {
        check("let r#unsafe = 1; r#type", &["let", "r#unsafe", "r#type"]);
        // A name ending in `r` or `b` followed by a string is not a raw-string prefix.
        check(r#"bar"x" y"#, &["bar", "y"]);
    }

    #[test]
    fn lines_are_counted_through_comments_and_strings() {
        let scan = scan("a\n/* x\ny */ b\n\"s\nt\" c\n// d\ne");
        let lines: Vec<(String, usize)> = scan
            .tokens
            .iter()
            .filter_map(|t| match t {
                Token::Ident { text, line, .. } => Some((text.clone(), *line)),
                Token::Punct { .. } => None,
            })
            .collect();
        assert_eq!(
            lines,
            vec![
                ("a".to_owned(), 1),
                ("b".to_owned(), 3),
                ("c".to_owned(), 5),
                ("e".to_owned(), 7)
            ]
        );
        assert_eq!(
            scan.comments,
            vec![
                Comment {
                    line: 2,
                    text: "/* x\ny */".to_owned()
                },
                Comment {
                    line: 6,
                    text: "// d".to_owned()
                },
            ]
        );
    }
}

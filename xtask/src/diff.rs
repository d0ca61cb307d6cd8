//! A line diff for showing a stale generated file: removed lines `-`, added lines `+`, and up to
//! three unchanged lines of context around each change, under an `@@ -old +new @@` line header.
//!
//! The longest-common-subsequence table is quadratic, so files above [`MAX_LINES`] lines get a
//! one-line summary of the first difference instead of a full diff.

use std::fmt::Write as _;

/// The most lines per side that get a full diff.
pub const MAX_LINES: usize = 2_000;

/// Unchanged lines shown around each change.
const CONTEXT: usize = 3;

/// One line of the edit script.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Edit<'a> {
    Same(&'a str),
    Removed(&'a str),
    Added(&'a str),
}

/// The diff from `old` to `new`; empty when they are equal.
pub fn unified(old: &str, new: &str) -> String {
    if old == new {
        return String::new();
    }
    let a: Vec<&str> = old.lines().collect();
    let b: Vec<&str> = new.lines().collect();
    if a.len() > MAX_LINES || b.len() > MAX_LINES {
        let first = a
            .iter()
            .zip(&b)
            .position(|(x, y)| x != y)
            .unwrap_or(a.len().min(b.len()));
        return format!(
            "(too long for a full diff: {} lines before, {} after; first difference at line {})\n",
            a.len(),
            b.len(),
            first + 1
        );
    }
    if a == b {
        return "(the files differ only in line endings or a final newline)\n".to_owned();
    }
    render(&edits(&a, &b))
}

/// The edit script turning `a` into `b`, from the longest common subsequence.
fn edits<'a>(a: &[&'a str], b: &[&'a str]) -> Vec<Edit<'a>> {
    // lcs[i][j] is the length of the longest common subsequence of a[i..] and b[j..].
    let width = b.len() + 1;
    let mut lcs = vec![0u32; (a.len() + 1) * width];
    for i in (0..a.len()).rev() {
        for j in (0..b.len()).rev() {
            lcs[i * width + j] = if a[i] == b[j] {
                lcs[(i + 1) * width + j + 1] + 1
            } else {
                lcs[(i + 1) * width + j].max(lcs[i * width + j + 1])
            };
        }
    }
    let (mut i, mut j) = (0, 0);
    let mut out = Vec::with_capacity(a.len() + b.len());
    while i < a.len() || j < b.len() {
        if i < a.len() && j < b.len() && a[i] == b[j] {
            out.push(Edit::Same(a[i]));
            i += 1;
            j += 1;
        } else if i < a.len()
            && (j == b.len() || lcs[(i + 1) * width + j] >= lcs[i * width + j + 1])
        {
            // Removals before additions, as `diff -u` shows a replaced line.
            out.push(Edit::Removed(a[i]));
            i += 1;
        } else {
            out.push(Edit::Added(b[j]));
            j += 1;
        }
    }
    out
}

/// Renders an edit script as hunks with context.
fn render(script: &[Edit<'_>]) -> String {
    let changed: Vec<usize> = script
        .iter()
        .enumerate()
        .filter(|(_, e)| !matches!(e, Edit::Same(_)))
        .map(|(i, _)| i)
        .collect();
    let mut out = String::new();
    let mut k = 0;
    while k < changed.len() {
        // A hunk covers changes whose context windows touch.
        let start = changed[k].saturating_sub(CONTEXT);
        let mut end = changed[k];
        while k < changed.len() && changed[k] <= end + 2 * CONTEXT + 1 {
            end = changed[k];
            k += 1;
        }
        let end = (end + CONTEXT + 1).min(script.len());
        let old_line = 1 + script[..start]
            .iter()
            .filter(|e| !matches!(e, Edit::Added(_)))
            .count();
        let new_line = 1 + script[..start]
            .iter()
            .filter(|e| !matches!(e, Edit::Removed(_)))
            .count();
        let _ = writeln!(out, "@@ -{old_line} +{new_line} @@");
        for edit in &script[start..end] {
            let _ = match edit {
                Edit::Same(line) => writeln!(out, " {line}"),
                Edit::Removed(line) => writeln!(out, "-{line}"),
                Edit::Added(line) => writeln!(out, "+{line}"),
            };
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn check(old: &str, new: &str, expected: &str) {
        assert_eq!(unified(old, new), expected, "old: {old:?}\nnew: {new:?}");
    }

    #[test]
    fn equal_texts_have_no_diff() {
        check("a\nb\n", "a\nb\n", "");
    }

    #[test]
    fn a_changed_line_shows_with_context() {
        check(
            "1\n2\n3\n4\n5\n6\n7\n8\n",
            "1\n2\n3\n4\nFIVE\n6\n7\n8\n",
            "@@ -2 +2 @@\n 2\n 3\n 4\n-5\n+FIVE\n 6\n 7\n 8\n",
        );
    }

    #[test]
    fn added_and_removed_lines() {
        check("a\nb\n", "a\nb\nc\n", "@@ -1 +1 @@\n a\n b\n+c\n");
        check("a\nb\nc\n", "a\nc\n", "@@ -1 +1 @@\n a\n-b\n c\n");
        check("", "x\n", "@@ -1 +1 @@\n+x\n");
    }

    #[test]
    fn distant_changes_make_separate_hunks() {
        let old: String = (1..=20).map(|i| format!("{i}\n")).collect();
        let new: String = (1..=20)
            .map(|i| match i {
                2 => "two\n".to_owned(),
                19 => "nineteen\n".to_owned(),
                _ => format!("{i}\n"),
            })
            .collect();
        check(
            &old,
            &new,
            "@@ -1 +1 @@\n 1\n-2\n+two\n 3\n 4\n 5\n@@ -16 +16 @@\n 16\n 17\n 18\n-19\n+nineteen\n 20\n",
        );
    }

    #[test]
    fn line_ending_only_differences_are_named() {
        check(
            "a\n",
            "a",
            "(the files differ only in line endings or a final newline)\n",
        );
    }

    #[test]
    fn long_files_get_a_summary() {
        let old: String = (0..=MAX_LINES).map(|i| format!("{i}\n")).collect();
        let new = old.replacen("7\n", "seven\n", 1);
        check(&old, &new, &format!("(too long for a full diff: {n} lines before, {n} after; first difference at line 8)\n", n = MAX_LINES + 1));
    }
}

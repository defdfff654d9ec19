//! `docs/protocol.md` is the normative protocol description: its error-code table must list
//! exactly the codes of [`ErrorCode`], with the same retry policy and HTTP status, and its
//! close-code table exactly the codes of [`CloseCode`].

use std::collections::HashMap;
use std::path::Path;

use tidemark_protocol::{CloseCode, ErrorCode, Limits};

fn protocol_md() -> String {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../docs/protocol.md");
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// The text of the section `heading` (e.g. `## Error codes`), up to the next `## ` heading.
fn section<'a>(doc: &'a str, heading: &str) -> &'a str {
    doc.split(heading)
        .nth(1)
        .unwrap_or_else(|| panic!("docs/protocol.md has a `{heading}` section"))
        .split("\n## ")
        .next()
        .unwrap()
}

/// The trimmed cells of a markdown table row.
fn cells(row: &str) -> Vec<&str> {
    row.trim_matches('|').split(" | ").map(str::trim).collect()
}

#[test]
fn error_table_matches_error_code() {
    let doc = protocol_md();
    let table = section(&doc, "## Error codes");
    let mut rows = HashMap::new();
    for line in table.lines().filter(|l| l.starts_with("| `")) {
        let cells = cells(line);
        assert_eq!(cells.len(), 4, "row: {line}");
        let code = cells[0].trim_matches('`');
        let retryable = match cells[2] {
            "yes" => true,
            "no" => false,
            other => panic!("{code}: retryable must be yes/no, got {other}"),
        };
        let status: u16 = cells[3].parse().expect("HTTP status");
        assert!(
            rows.insert(code.to_owned(), (retryable, status)).is_none(),
            "{code} listed twice"
        );
    }
    assert_eq!(
        rows.len(),
        ErrorCode::ALL.len(),
        "codes in the table: {rows:?}"
    );
    for code in ErrorCode::ALL {
        let (retryable, status) = rows
            .get(code.as_str())
            .unwrap_or_else(|| panic!("{code} missing from docs/protocol.md"));
        assert_eq!(*retryable, code.retryable(), "{code} retryable");
        assert_eq!(*status, code.http_status(), "{code} HTTP status");
    }
}

#[test]
fn documented_limits_are_the_defaults() {
    let doc = protocol_md();
    let l = Limits::default();
    for n in [
        l.max_frame_bytes,
        l.max_body_bytes,
        l.max_recipients,
        l.max_page_entries as usize,
        l.default_page_entries as usize,
    ] {
        assert!(doc.contains(&n.to_string()), "{n} not in docs/protocol.md");
    }
    assert!(doc.contains(&format!("1–{} bytes", l.max_id_bytes)));
}

#[test]
fn close_code_table_matches_close_code() {
    let doc = protocol_md();
    let table = section(&doc, "## Close codes");
    let mut rows = HashMap::new();
    for line in table
        .lines()
        .filter(|l| l.starts_with("| ") && !l.starts_with("| code"))
    {
        let cells = cells(line);
        let Ok(num) = cells[0].parse::<u16>() else {
            continue; // the separator row
        };
        let name = cells[1].trim_matches('`').to_owned();
        assert!(rows.insert(num, name).is_none(), "{num} listed twice");
    }
    assert_eq!(
        rows.len(),
        CloseCode::ALL.len(),
        "codes in the table: {rows:?}"
    );
    for code in CloseCode::ALL {
        let name = rows
            .get(&code.as_u16())
            .unwrap_or_else(|| panic!("{code} missing from docs/protocol.md"));
        assert_eq!(name, code.as_str(), "{code}");
    }
}

//! The figures in `docs/` are the committed files under `docs/perf/` (issue 11, item 13).
//!
//! - Every committed load report parses, including those written before
//!   `acked_per_s_while_sending` existed.
//! - Every table of `docs/performance.md` that follows a `<!-- table: … -->` marker is what
//!   `tidemark bench report` prints from the file the marker names (`markdown_table`,
//!   `ladder_table`, `cpu_table`; `catchup_table`, `commit_table` for the files of `bench
//!   catchup` and `bench commit`), or, for `lua(…)`, the values of `lua.json`; every committed
//!   report is shown in at least one such table, and the engine reports add up.
//! - Every committed plot (`docs/perf/<name>/*.png|svg`) is what `write_plots` draws from
//!   `docs/perf/<name>.json`, byte for byte.
//! - Every `perf/…` file the documentation names exists.
//!
//! No Redis is needed: everything is read from the repository.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use tidemark_bench::load::{cpu_table, from_json, ladder_table, markdown_table, RunReport};
use tidemark_bench::plot::write_plots;

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn perf_dir() -> PathBuf {
    repo().join("docs/perf")
}

fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// `docs/perf/*.json` that are load reports (`{"runs":[…]}`), by file name.
fn load_reports() -> Vec<(String, Vec<RunReport>)> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir(perf_dir()).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().and_then(|e| e.to_str()) != Some("json") {
            continue;
        }
        let text = read(&path);
        let value: serde_json::Value = serde_json::from_str(&text).unwrap();
        if value.get("runs").is_none() {
            continue; // lua.json
        }
        if tidemark_bench::engine::report_kind(&text).is_some() {
            continue; // bench catchup / bench commit: engine_reports()
        }
        let runs = from_json(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        let name = path.file_name().unwrap().to_string_lossy().into_owned();
        out.push((name, runs));
    }
    out.sort_by(|a, b| a.0.cmp(&b.0));
    out
}

/// `docs/perf/*.json` written by `bench catchup` or `bench commit`: (file name, kind, text).
fn engine_reports() -> Vec<(String, String, String)> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir(perf_dir()).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().and_then(|e| e.to_str()) != Some("json") {
            continue;
        }
        let text = read(&path);
        if let Some(kind) = tidemark_bench::engine::report_kind(&text) {
            let name = path.file_name().unwrap().to_string_lossy().into_owned();
            out.push((name, kind, text));
        }
    }
    out.sort();
    out
}

#[test]
fn committed_engine_reports_parse_and_add_up() {
    use tidemark_bench::catchup::CatchupReport;
    use tidemark_bench::commit::CommitReport;
    use tidemark_bench::engine::runs_from_json;
    let reports = engine_reports();
    let kinds: Vec<&str> = reports.iter().map(|(_, k, _)| k.as_str()).collect();
    assert!(
        kinds.contains(&"catchup") && kinds.contains(&"commit"),
        "{kinds:?}"
    );
    for (name, kind, text) in &reports {
        if kind == "catchup" {
            let runs: Vec<CatchupReport> = runs_from_json(text).unwrap();
            assert!(!runs.is_empty(), "{name}");
            for r in &runs {
                let records: u64 = r.per_mailbox.iter().map(|m| m.records).sum();
                assert_eq!(records, r.records, "{name}: every record on one instance");
                assert!(r.records_per_s > 0.0, "{name}");
            }
        } else {
            let runs: Vec<CommitReport> = runs_from_json(text).unwrap();
            assert!(!runs.is_empty(), "{name}");
            for r in &runs {
                let commits: u64 = r.per_core.iter().map(|c| c.commits).sum();
                assert_eq!(commits, r.commits, "{name}");
                assert!(r.sends > 0 && r.errors.is_empty(), "{name}: {:?}", r.errors);
            }
        }
    }
}

#[test]
fn committed_reports_parse() {
    let reports = load_reports();
    let names: Vec<&str> = reports.iter().map(|(n, _)| n.as_str()).collect();
    for want in [
        "ladder.json",
        "load-10k-in-process.json",
        "load-10k-reversed.json",
        "load-10k.json",
        "load.json",
    ] {
        assert!(names.contains(&want), "{want} missing from {names:?}");
    }
    for (name, runs) in &reports {
        assert!(!runs.is_empty(), "{name}");
        for r in runs {
            assert!(r.sent > 0 && r.send_acked <= r.sent, "{name}: {r:?}");
            if let Some(n) = r.send_acked_while_sending {
                assert!(n <= r.send_acked, "{name}");
            }
        }
    }
}

/// The table lines (`|…`) right after line `i`.
fn table_after(lines: &[&str], i: usize) -> String {
    let mut out = String::new();
    for l in &lines[i + 1..] {
        if !l.starts_with('|') {
            break;
        }
        out.push_str(l);
        out.push('\n');
    }
    out
}

fn check_lua_table(table: &str, file: &Path) {
    let json: serde_json::Value = serde_json::from_str(&read(file)).unwrap();
    let rows: Vec<&str> = table.lines().skip(2).collect();
    assert_eq!(rows.len(), 5, "one row per script:\n{table}");
    for row in rows {
        let cells: Vec<&str> = row.trim_matches('|').split('|').map(|c| c.trim()).collect();
        let name = cells[0].trim_matches('`');
        let v1 = json["scripts"][name]["packed-v1"].as_f64().unwrap();
        let v2 = json["scripts"][name]["packed-v2"].as_f64().unwrap();
        assert_eq!(
            cells[1..],
            [
                format!("{v1:.2}µs"),
                format!("{v2:.2}µs"),
                format!("{:.2}", v2 / v1)
            ],
            "{row}"
        );
    }
}

#[test]
fn tables_in_performance_md_are_their_files() {
    let doc = read(&repo().join("docs/performance.md"));
    let lines: Vec<&str> = doc.lines().collect();
    let mut shown = BTreeSet::new();
    let mut markers = 0;
    for (i, line) in lines.iter().enumerate() {
        let Some(rest) = line.strip_prefix("<!-- table: ") else {
            continue;
        };
        markers += 1;
        let spec = rest.strip_suffix(" -->").expect("marker ends with -->");
        let (kind, file) = spec
            .strip_suffix(')')
            .and_then(|s| s.split_once('('))
            .unwrap_or_else(|| panic!("marker {spec:?}: want kind(docs/perf/FILE.json)"));
        let path = repo().join(file);
        let table = table_after(&lines, i);
        assert!(!table.is_empty(), "no table after {line:?}");
        if kind == "lua" {
            check_lua_table(&table, &path);
            continue;
        }
        let text = read(&path);
        let want = match kind {
            "markdown_table" => markdown_table(&from_json(&text).unwrap()),
            "ladder_table" => ladder_table(&from_json(&text).unwrap()),
            "cpu_table" => cpu_table(&from_json(&text).unwrap()),
            "catchup_table" => tidemark_bench::catchup::markdown_table(
                &tidemark_bench::engine::runs_from_json(&text).unwrap(),
            ),
            "commit_table" => tidemark_bench::commit::markdown_table(
                &tidemark_bench::engine::runs_from_json(&text).unwrap(),
            ),
            other => panic!("unknown table kind {other:?}"),
        };
        assert_eq!(
            table, want,
            "the table after {line:?} is not what its file gives \
             (`tidemark bench report {file}` prints it)"
        );
        shown.insert(
            Path::new(file)
                .file_name()
                .unwrap()
                .to_string_lossy()
                .into_owned(),
        );
    }
    assert!(markers >= 7, "only {markers} table markers");
    let engine = engine_reports().into_iter().map(|(name, _, _)| name);
    for name in load_reports()
        .into_iter()
        .map(|(name, _)| name)
        .chain(engine)
    {
        assert!(
            shown.contains(&name),
            "docs/perf/{name} is shown in no table"
        );
    }
}

#[test]
fn committed_plots_redraw_from_their_files() {
    let tmp = tempfile::tempdir().unwrap();
    let mut dirs = 0;
    for entry in std::fs::read_dir(perf_dir()).unwrap() {
        let dir = entry.unwrap().path();
        if !dir.is_dir() {
            continue;
        }
        dirs += 1;
        let name = dir.file_name().unwrap().to_string_lossy().into_owned();
        let json = perf_dir().join(format!("{name}.json"));
        let runs = from_json(&read(&json)).unwrap();
        let committed: BTreeSet<String> = std::fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        let ladder = committed.contains("ladder.svg");
        let out = tmp.path().join(&name);
        let drawn: BTreeSet<String> = write_plots(&out, &runs, ladder)
            .unwrap()
            .iter()
            .map(|p| p.file_name().unwrap().to_string_lossy().into_owned())
            .collect();
        assert_eq!(drawn, committed, "docs/perf/{name}/");
        for file in &committed {
            let a = std::fs::read(dir.join(file)).unwrap();
            let b = std::fs::read(out.join(file)).unwrap();
            assert!(
                a == b,
                "docs/perf/{name}/{file} is not what docs/perf/{name}.json draws \
                 (`tidemark bench report docs/perf/{name}.json{} --plot docs/perf/{name}`)",
                if ladder { " --ladder" } else { "" }
            );
        }
    }
    assert!(dirs >= 2, "only {dirs} plot directories");
}

#[test]
fn docs_name_only_committed_perf_files() {
    let mut pages = vec![repo().join("README.md")];
    for dir in ["docs", "docs/adr"] {
        for entry in std::fs::read_dir(repo().join(dir)).unwrap() {
            let path = entry.unwrap().path();
            if path.extension().and_then(|e| e.to_str()) == Some("md") {
                pages.push(path);
            }
        }
    }
    let mut named = 0;
    for page in pages {
        let text = read(&page);
        for (at, _) in text.match_indices("perf/") {
            let tail: String = text[at + "perf/".len()..]
                .chars()
                .take_while(|c| c.is_ascii_alphanumeric() || "-_./".contains(*c))
                .collect();
            let tail = tail.trim_end_matches('.');
            if !(tail.ends_with(".json") || tail.ends_with(".svg") || tail.ends_with(".png")) {
                continue;
            }
            named += 1;
            assert!(
                perf_dir().join(tail).is_file(),
                "{} names perf/{tail}, which is not committed",
                page.display()
            );
        }
    }
    assert!(named > 10, "only {named} perf files named");
}

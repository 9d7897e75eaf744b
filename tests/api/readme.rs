//! README.md's "From zero to a protected endpoint" shows `examples/quickstart.rs` as a new
//! crate's `src/main.rs`; CI builds that example and runs its test, so the README's code is
//! checked only while the two are the same.

#[test]
fn the_readme_quickstart_is_the_example_ci_runs() {
    let root = env!("CARGO_MANIFEST_DIR");
    let readme = std::fs::read_to_string(format!("{root}/README.md")).unwrap();
    let example = std::fs::read_to_string(format!("{root}/examples/quickstart.rs")).unwrap();
    let marker = "<!-- quickstart: examples/quickstart.rs -->";
    let after = readme
        .split_once(marker)
        .map(|(_, rest)| rest)
        .expect("README.md marks its quickstart block");
    let block = after
        .split_once("```rust,ignore\n")
        .and_then(|(_, rest)| rest.split_once("\n```\n"))
        .map(|(code, _)| code)
        .expect("a rust,ignore block follows the marker");
    assert_eq!(
        block.trim_end(),
        example.trim_end(),
        "README.md's quickstart and examples/quickstart.rs differ: copy the example into the README"
    );
}

/// Every shell block (```` ```sh ````) in README.md and docs/ says whether CI runs it: its first
/// line is `# run by .ci/run` (and then each of its commands is in `.ci/run`, word for word) or
/// `# not run in CI[ as written, alone, ...]: <why>`.
#[test]
fn every_shell_block_in_the_docs_says_whether_ci_runs_it() {
    let root = env!("CARGO_MANIFEST_DIR");
    let ci = std::fs::read_to_string(format!("{root}/.ci/run")).unwrap();
    let mut files = vec![format!("{root}/README.md")];
    let mut docs: Vec<String> = std::fs::read_dir(format!("{root}/docs"))
        .unwrap()
        .map(|e| e.unwrap().path().display().to_string())
        .filter(|p| p.ends_with(".md"))
        .collect();
    docs.sort();
    files.extend(docs);
    let mut problems = Vec::new();
    let mut blocks = 0;
    for file in &files {
        let text = std::fs::read_to_string(file).unwrap();
        let mut lines = text.lines().enumerate();
        while let Some((n, line)) = lines.next() {
            if line.trim_end() != "```sh" {
                continue;
            }
            blocks += 1;
            let body: Vec<&str> = lines
                .by_ref()
                .map(|(_, l)| l)
                .take_while(|l| !l.starts_with("```"))
                .collect();
            let at = format!("{}:{}", file.trim_start_matches(root), n + 1);
            let first = body.first().copied().unwrap_or_default();
            let not_run = first
                .strip_prefix("# not run in CI")
                .and_then(|rest| rest.split_once(": "));
            if let Some((_, why)) = not_run {
                if why.trim().len() < 10 {
                    problems.push(format!("{at}: say why it is not run in CI"));
                }
            } else if first.starts_with("# run by .ci/run") {
                for command in commands(&body[1..]) {
                    if !ci.contains(&command) {
                        problems.push(format!("{at}: `{command}` is not in .ci/run"));
                    }
                }
            } else {
                problems.push(format!(
                    "{at}: the first line must be `# run by .ci/run` or `# not run in CI: <why>`"
                ));
            }
        }
    }
    assert!(
        blocks >= 20,
        "found only {blocks} shell blocks: the scan is broken"
    );
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

/// The commands of a shell block: continuation lines joined, comments dropped.
fn commands(lines: &[&str]) -> Vec<String> {
    let mut out = Vec::new();
    let mut current = String::new();
    for line in lines {
        let code = match line.find(" #") {
            Some(i) => &line[..i],
            None if line.trim_start().starts_with('#') => "",
            None => line,
        };
        let code = code.trim();
        if let Some(head) = code.strip_suffix('\\') {
            current.push_str(head.trim());
            current.push(' ');
            continue;
        }
        current.push_str(code);
        if !current.trim().is_empty() {
            out.push(current.trim().to_owned());
        }
        current.clear();
    }
    out
}

#[test]
fn a_shell_blocks_commands_join_continuations_and_drop_comments() {
    let lines = [
        "FOO=1 \\",
        "  cargo test --all-features   # everything",
        "# a comment",
        "",
        "cargo bench",
    ];
    assert_eq!(
        commands(&lines),
        ["FOO=1 cargo test --all-features", "cargo bench"]
    );
}

//! The docs' code is checked. docs/http.md's "From zero to a protected endpoint" shows
//! `examples/quickstart.rs` as a new crate's `src/main.rs`; CI builds that example and runs its
//! test, so the page's code is checked only while the two are the same. Every other Rust block
//! of README.md and docs/ is a doctest (a guide is its module's rustdoc, `src/lib.rs` includes
//! README.md), or a checked excerpt of a source file; every shell block says whether CI runs it.

#[test]
fn the_http_guide_quickstart_is_the_example_ci_runs() {
    let root = env!("CARGO_MANIFEST_DIR");
    let readme = std::fs::read_to_string(format!("{root}/docs/http.md")).unwrap();
    let example = std::fs::read_to_string(format!("{root}/examples/quickstart.rs")).unwrap();
    let after = readme
        .split_once(QUICKSTART_MARKER)
        .map(|(_, rest)| rest)
        .expect("docs/http.md marks its quickstart block");
    let block = after
        .split_once("```rust,ignore\n")
        .and_then(|(_, rest)| rest.split_once("\n```\n"))
        .map(|(code, _)| code)
        .expect("a rust,ignore block follows the marker");
    assert_eq!(
        block.trim_end(),
        example.trim_end(),
        "docs/http.md's quickstart and examples/quickstart.rs differ: copy the example into the page"
    );
}

/// Every shell block (```` ```sh ````) in README.md and docs/ says whether CI runs it, on the
/// line before the block (`<!-- run by .ci/run -->`, the README's form, which keeps the block
/// itself clean for a reader) or as the block's first line (`# run by .ci/run`): run by CI (and
/// then each of its commands is in `.ci/run`, word for word) or `not run in CI[ as written,
/// alone, ...]: <why>`.
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
        let mut before = "";
        while let Some((n, line)) = lines.next() {
            if line.trim_end() != "```sh" {
                before = line;
                continue;
            }
            blocks += 1;
            let body: Vec<&str> = lines
                .by_ref()
                .map(|(_, l)| l)
                .take_while(|l| !l.starts_with("```"))
                .collect();
            let at = format!("{}:{}", file.trim_start_matches(root), n + 1);
            // The note on the line before the block, else the block's first line.
            let (note, commands_from) = match before
                .trim()
                .strip_prefix("<!-- ")
                .and_then(|c| c.strip_suffix(" -->"))
            {
                Some(note) => (note, 0),
                None => {
                    let first = body.first().copied().unwrap_or_default();
                    (first.strip_prefix("# ").unwrap_or_default(), 1)
                }
            };
            let not_run = note
                .strip_prefix("not run in CI")
                .and_then(|rest| rest.split_once(": "));
            if let Some((_, why)) = not_run {
                if why.trim().len() < 10 {
                    problems.push(format!("{at}: say why it is not run in CI"));
                }
            } else if note.starts_with("run by .ci/run") {
                for command in commands(&body[commands_from.min(body.len())..]) {
                    if !ci.contains(&command) {
                        problems.push(format!("{at}: `{command}` is not in .ci/run"));
                    }
                }
            } else {
                problems.push(format!(
                    "{at}: say `run by .ci/run` or `not run in CI: <why>`, before the block or first in it"
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

/// The quickstart block's marker: the block after it is `examples/quickstart.rs`, checked above.
const QUICKSTART_MARKER: &str = "<!-- quickstart: examples/quickstart.rs -->";

/// README.md, then docs/*.md in name order, as paths relative to the crate root.
fn doc_pages(root: &str) -> Vec<String> {
    let mut docs: Vec<String> = std::fs::read_dir(format!("{root}/docs"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|name| name.ends_with(".md"))
        .map(|name| format!("docs/{name}"))
        .collect();
    docs.sort();
    let mut pages = vec!["README.md".to_owned()];
    pages.extend(docs);
    pages
}

/// Every Rust block of README.md and docs/ is compiled: a file of `src/` includes the page as
/// docs (`include_str!`: a guide is its module's rustdoc, README.md is in `src/lib.rs`), and no
/// block is fenced `ignore` except the quickstart (checked above) and checked excerpts, marked
/// `<!-- excerpt: <file> -->` on the line before the fence, whose visible lines must appear in
/// that file (any marked block, compiled or not, is checked so). A fence with no language is
/// refused too: rustdoc would compile it as Rust.
#[test]
fn every_rust_block_in_the_docs_is_compiled_or_a_checked_excerpt() {
    let root = env!("CARGO_MANIFEST_DIR");
    let sources = rust_sources(root, "src");
    assert!(
        sources.iter().any(|(path, _)| path == "src/lib.rs"),
        "the scan of src/ is broken"
    );
    let read = |path: &str| std::fs::read_to_string(format!("{root}/{path}")).ok();
    let mut problems = Vec::new();
    let mut rust_blocks = 0;
    for page in doc_pages(root) {
        let text = std::fs::read_to_string(format!("{root}/{page}")).unwrap();
        let (n, found) = rust_block_problems(&page, &text, &sources, &read);
        rust_blocks += n;
        problems.extend(found);
    }
    assert!(
        rust_blocks >= 25,
        "found only {rust_blocks} Rust blocks: the scan is broken"
    );
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

/// A fenced block of a Markdown page.
#[derive(Debug)]
struct Fenced {
    /// The line of the opening fence, from 1.
    line: usize,
    /// The info string: `rust,no_run`, `sh`, `` (none).
    info: String,
    /// The HTML comment on the line before the fence, without `<!--` and `-->`.
    marker: Option<String>,
    body: Vec<String>,
}

impl Fenced {
    /// Whether rustdoc takes the block for Rust: no language, or `rust` among its attributes.
    fn is_rust(&self) -> bool {
        self.info.is_empty() || self.attributes().any(|a| a == "rust")
    }

    fn attributes(&self) -> impl Iterator<Item = &str> {
        self.info
            .split([',', ' ', '\t'])
            .map(str::trim)
            .filter(|a| !a.is_empty())
    }

    /// The lines a reader sees: rustdoc hides `# ` lines (and a lone `#`).
    fn visible(&self) -> Vec<&str> {
        self.body
            .iter()
            .map(String::as_str)
            .filter(|l| {
                let t = l.trim_start();
                t != "#" && !t.starts_with("# ")
            })
            .collect()
    }
}

/// The fenced blocks of a page (fences of backticks, indented or not).
fn fenced_blocks(text: &str) -> Vec<Fenced> {
    let lines: Vec<&str> = text.lines().collect();
    let mut out = Vec::new();
    let mut i = 0;
    while i < lines.len() {
        let Some(info) = lines[i].trim_start().strip_prefix("```") else {
            i += 1;
            continue;
        };
        let marker = i
            .checked_sub(1)
            .map(|p| lines[p].trim())
            .and_then(|l| l.strip_prefix("<!--"))
            .and_then(|l| l.strip_suffix("-->"))
            .map(|l| l.trim().to_owned());
        let start = i;
        i += 1;
        let mut body = Vec::new();
        while i < lines.len() && !lines[i].trim_start().starts_with("```") {
            body.push(lines[i].to_owned());
            i += 1;
        }
        i += 1; // the closing fence
        out.push(Fenced {
            line: start + 1,
            info: info.trim().to_owned(),
            marker,
            body,
        });
    }
    out
}

/// The `.rs` files under `dir` (a path from the crate root), at any depth, as (path from the
/// crate root, text).
fn rust_sources(root: &str, dir: &str) -> Vec<(String, String)> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir(format!("{root}/{dir}")).unwrap() {
        let entry = entry.unwrap();
        let path = format!("{dir}/{}", entry.file_name().to_string_lossy());
        if entry.file_type().unwrap().is_dir() {
            out.extend(rust_sources(root, &path));
        } else if path.ends_with(".rs") {
            let text = std::fs::read_to_string(format!("{root}/{path}")).unwrap();
            out.push((path, text));
        }
    }
    out
}

/// Whether one of `sources` (path from the crate root, text) includes `page` (a path from the
/// crate root) with `include_str!`, by the path from that file's folder: `"../docs/x.md"` from
/// `src/lib.rs`, `"../../docs/x.md"` from `src/m/mod.rs`.
fn included_by(page: &str, sources: &[(String, String)]) -> bool {
    sources.iter().any(|(path, text)| {
        let depth = path.matches('/').count();
        let include = format!("include_str!(\"{}{page}\")", "../".repeat(depth));
        text.contains(&include)
    })
}

/// The problems of one page's Rust blocks (and their number): see
/// [`every_rust_block_in_the_docs_is_compiled_or_a_checked_excerpt`]. `page` is the path from
/// the crate root, `sources` the files of `src/` (path, text), `read` reads an excerpt's source
/// file.
fn rust_block_problems(
    page: &str,
    text: &str,
    sources: &[(String, String)],
    read: &dyn Fn(&str) -> Option<String>,
) -> (usize, Vec<String>) {
    let mut problems = Vec::new();
    let mut rust_blocks = 0;
    for block in fenced_blocks(text) {
        let at = format!("{page}:{}", block.line);
        let excerpt_of = block
            .marker
            .as_deref()
            .and_then(|m| m.strip_prefix("excerpt:"))
            .map(str::trim);
        if block.info.is_empty() {
            problems.push(format!(
                "{at}: a fence without a language is compiled as Rust: name it (```text, ...)"
            ));
            continue;
        }
        if !block.is_rust() {
            if excerpt_of.is_some() {
                problems.push(format!(
                    "{at}: an excerpt marker on a block that is not Rust"
                ));
            }
            continue;
        }
        rust_blocks += 1;
        let ignored = block
            .attributes()
            .any(|a| a == "ignore" || a.starts_with("ignore-"));
        let quickstart = block
            .marker
            .as_deref()
            .is_some_and(|m| format!("<!-- {m} -->") == QUICKSTART_MARKER);
        if ignored && !quickstart && excerpt_of.is_none() {
            problems.push(format!(
                "{at}: `{}` is not compiled: make it a doctest (hidden `# ` lines for its setup), \
                 `rust,no_run` if it needs a server, or a checked excerpt \
                 (`<!-- excerpt: <file> -->` on the line before)",
                block.info
            ));
        }
        if block.attributes().any(|a| a == "compile_fail")
            && !block
                .marker
                .as_deref()
                .is_some_and(|m| m.starts_with("must not compile:"))
        {
            problems.push(format!(
                "{at}: a compile_fail block says why on the line before \
                 (`<!-- must not compile: <why> -->`)"
            ));
        }
        if let Some(path) = excerpt_of {
            match read(path) {
                None => problems.push(format!("{at}: the excerpt's file {path} cannot be read")),
                Some(source) if !is_excerpt_of(&block.visible(), &source) => {
                    problems.push(format!(
                        "{at}: the block is not an excerpt of {path} any more: copy it again \
                         (leading indentation and the file's `///` lines may differ; \
                         `// ...` skips lines)"
                    ))
                }
                Some(_) => {}
            }
        }
    }
    if rust_blocks > 0 && !included_by(page, sources) {
        problems.push(format!(
            "{page}: has Rust blocks but no file of src/ compiles them: make the page its \
             module's docs (`#![doc = include_str!(\"../../{page}\")]`, in a `cfg_attr` on the \
             features its blocks use)"
        ));
    }
    (rust_blocks, problems)
}

/// Whether `excerpt`'s lines appear in `source` one after the other, leading indentation
/// ignored. The source's `///` doc-comment lines may be left out of the excerpt, and an excerpt
/// line `// ...` stands for any number of source lines.
fn is_excerpt_of(excerpt: &[&str], source: &str) -> bool {
    let source: Vec<&str> = source.lines().map(str::trim).collect();
    let mut from = 0;
    for chunk in excerpt.split(|l| l.trim() == "// ...") {
        let chunk: Vec<&str> = chunk.iter().map(|l| l.trim()).collect();
        if chunk.is_empty() {
            continue;
        }
        match (from..source.len()).find_map(|start| matches_at(&source, start, &chunk)) {
            Some(end) => from = end,
            None => return false,
        }
    }
    true
}

/// Where the match of `chunk` starting at `source[start]` ends, skipping `///` lines.
fn matches_at(source: &[&str], start: usize, chunk: &[&str]) -> Option<usize> {
    let mut i = start;
    for want in chunk {
        loop {
            let have = *source.get(i)?;
            i += 1;
            if have == *want {
                break;
            }
            if !have.starts_with("///") {
                return None;
            }
        }
    }
    Some(i)
}

#[test]
fn an_excerpt_matches_its_source_whatever_the_indentation_and_doc_comments() {
    let source = "impl A {
    /// Doc.
    fn f(&self) -> u8 {
        1
    }

    fn g() {}
}
";
    let quotes = |lines: &[&str]| is_excerpt_of(lines, source);
    assert!(quotes(&["fn f(&self) -> u8 {", "    1", "}"]));
    assert!(quotes(&["/// Doc.", "fn f(&self) -> u8 {"]));
    assert!(quotes(&["impl A {", "fn f(&self) -> u8 {"]));
    assert!(quotes(&["fn f(&self) -> u8 {", "// ...", "fn g() {}"]));
    assert!(!quotes(&["fn f(&self) -> u16 {"]));
    assert!(!quotes(&["fn f(&self) -> u8 {", "fn g() {}"]));
    assert!(!quotes(&["/// Other doc.", "fn f(&self) -> u8 {"]));
    assert!(!quotes(&["fn g() {}", "// ...", "fn f(&self) -> u8 {"]));
}

#[test]
fn the_rust_block_check_refuses_what_rustdoc_would_not_compile() {
    let page = "\
Compiled:

```rust,no_run
# async fn f() {}
let x = 1;
```

Not compiled, and no marker:

```rust,ignore
let y = 2;
```

A checked excerpt that matches, one that does not, and a bare fence:

<!-- excerpt: src/f.rs -->
```rust,ignore
fn f() -> u8 {
```

<!-- excerpt: src/f.rs -->
```rust
# use std::fmt;
fn f() -> u16 {
```

```
appendonly yes
```

```sh
echo not rust
```
";
    let read =
        |path: &str| (path == "src/f.rs").then(|| "/// F.\nfn f() -> u8 {\n    1\n}\n".to_owned());
    let module = |text: &str| vec![("src/m/mod.rs".to_owned(), text.to_owned())];
    let included = module("#![doc = include_str!(\"../../docs/x.md\")]");
    let (n, problems) = rust_block_problems("docs/x.md", page, &included, &read);
    assert_eq!(n, 4, "{problems:?}");
    let lines: Vec<&str> = problems
        .iter()
        .map(|p| p.split(": ").next().unwrap())
        .collect();
    assert_eq!(
        lines,
        ["docs/x.md:10", "docs/x.md:22", "docs/x.md:27"],
        "{problems:#?}"
    );
    assert!(problems[0].contains("is not compiled"));
    assert!(problems[1].contains("not an excerpt of src/f.rs"));
    assert!(problems[2].contains("without a language"));

    // Not included, or included by a path that is not the page's from that file: refused.
    for sources in [
        module(""),
        module("#![doc = include_str!(\"../docs/x.md\")]"),
        module("#![doc = include_str!(\"../../docs/y.md\")]"),
    ] {
        let (_, problems) = rust_block_problems("docs/x.md", page, &sources, &read);
        assert!(
            problems
                .last()
                .unwrap()
                .contains("no file of src/ compiles them"),
            "{sources:?}: {problems:#?}"
        );
    }
    let quickstart = format!("{QUICKSTART_MARKER}\n```rust,ignore\nfn main() {{}}\n```\n");
    let readme = &[(
        "src/lib.rs".to_owned(),
        "#[doc = include_str!(\"../README.md\")]".to_owned(),
    )];
    assert_eq!(
        rust_block_problems("README.md", &quickstart, readme, &read),
        (1, vec![])
    );
    let must_not = "```rust,compile_fail\nlet x: u8 = \"\";\n```\n";
    let (_, problems) = rust_block_problems("README.md", must_not, readme, &read);
    assert!(problems[0].contains("says why"), "{problems:#?}");
    let said = format!("<!-- must not compile: a str is no u8 -->\n{must_not}");
    assert_eq!(
        rust_block_problems("README.md", &said, readme, &read),
        (1, vec![])
    );
}

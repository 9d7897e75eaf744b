//! The crate's layers, lowest first, and the test that keeps every import pointing down
//! (`ARCHITECTURE.md`). A module may use a module of a lower layer, and one of its own layer
//! when the two do not use each other; never one above it. The test reads `src/` and fails on a
//! reverse import, on a two-way import, and on a top-level module missing from [`LAYERS`].

/// Every top-level module of `src/`, by layer, lowest first.
pub(super) const LAYERS: &[(&str, &[&str])] = &[
    (
        "domain",
        &[
            "state",
            "key",
            "fingerprint",
            "response",
            "outcome",
            "record",
            "provider_key",
            "error",
            "setters",
            "debug_fields",
        ],
    ),
    ("stores and providers", &["store", "provider"]),
    ("telemetry", &["telemetry"]),
    ("executor", &["executor"]),
    ("workflow", &["workflow"]),
    ("sweeper", &["sweeper"]),
    (
        "services and test kits",
        &["axum", "consumer", "conformance", "testkit"],
    ),
];

#[cfg(test)]
mod tests {
    use std::collections::{BTreeMap, BTreeSet};
    use std::path::Path;

    use super::LAYERS;

    fn layer_of(module: &str) -> Option<usize> {
        LAYERS.iter().position(|(_, ms)| ms.contains(&module))
    }

    /// The crate root's re-exports (`pub use module::{A, B};`): `crate::A` means `module`.
    fn root_names(lib: &str) -> BTreeMap<String, String> {
        let mut names = BTreeMap::new();
        for stmt in lib.split(';') {
            let stmt = stmt.trim();
            let Some(rest) = stmt.strip_prefix("pub use ") else {
                continue;
            };
            let Some((module, items)) = rest.split_once("::") else {
                continue;
            };
            let items = items.trim_start_matches('{').trim_end_matches('}');
            for item in items.split(',') {
                let name = item.trim().rsplit(' ').next().unwrap_or_default();
                if !name.is_empty() {
                    names.insert(name.to_owned(), module.trim().to_owned());
                }
            }
        }
        names
    }

    /// Code without comments and without the file's trailing `#[cfg(test)]` module.
    fn code_of(source: &str) -> String {
        let mut out = String::new();
        let mut lines = source.lines().peekable();
        while let Some(line) = lines.next() {
            let t = line.trim_start();
            if t.starts_with("#[cfg(test)]")
                && lines
                    .peek()
                    .is_some_and(|next| next.trim_start().starts_with("mod tests"))
            {
                break;
            }
            if t.starts_with("//") {
                continue;
            }
            out.push_str(line.split(" //").next().unwrap_or(line));
            out.push('\n');
        }
        out
    }

    fn ident_at(s: &str) -> &str {
        let end = s
            .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
            .unwrap_or(s.len());
        &s[..end]
    }

    /// The top-level modules `code` names, for a file at `depth` modules below the crate root
    /// (`store/sqlite/atomic.rs`: 3): `crate::m`, `crate::{m::x, n}`, `crate::Name` (a root
    /// re-export), and `super::` chains that climb to the root.
    fn imports(code: &str, depth: usize, roots: &BTreeMap<String, String>) -> BTreeSet<String> {
        let mut found = BTreeSet::new();
        let mut name = |ident: &str| {
            if layer_of(ident).is_some() {
                found.insert(ident.to_owned());
            } else if let Some(m) = roots.get(ident).filter(|m| layer_of(m).is_some()) {
                found.insert(m.clone());
            }
        };
        for (i, _) in code.match_indices("crate::") {
            if code[..i].ends_with('$') || code[..i].ends_with(|c: char| c.is_alphanumeric()) {
                continue;
            }
            let rest = &code[i + "crate::".len()..];
            if let Some(group) = rest.strip_prefix('{') {
                let group = &group[..group.find(';').unwrap_or(group.len())];
                // Only the group's first-level names: `m::{x, y}` names `m`.
                let mut nesting = 0;
                let mut start = true;
                for (j, c) in group.char_indices() {
                    match c {
                        '{' => nesting += 1,
                        '}' if nesting == 0 => break,
                        '}' => nesting -= 1,
                        ',' if nesting == 0 => start = true,
                        c if start && nesting == 0 && !c.is_whitespace() => {
                            start = false;
                            name(ident_at(&group[j..]));
                        }
                        _ => {}
                    }
                }
            } else {
                name(ident_at(rest));
            }
        }
        for (i, _) in code.match_indices("super::") {
            if code[..i].ends_with("super::") || code[..i].ends_with(|c: char| c.is_alphanumeric())
            {
                continue;
            }
            let mut rest = &code[i..];
            let mut climbs = 0;
            while let Some(r) = rest.strip_prefix("super::") {
                climbs += 1;
                rest = r;
            }
            if climbs >= depth {
                name(ident_at(rest));
            }
        }
        found
    }

    fn rs_files(dir: &Path, out: &mut Vec<std::path::PathBuf>) {
        for entry in std::fs::read_dir(dir).expect("read src/") {
            let path = entry.expect("read src/").path();
            if path.is_dir() {
                rs_files(&path, out);
            } else if path.extension().is_some_and(|e| e == "rs") {
                out.push(path);
            }
        }
    }

    /// Every top-level module's imports of the others.
    fn graph(src: &Path) -> BTreeMap<String, BTreeSet<String>> {
        let lib = std::fs::read_to_string(src.join("lib.rs")).expect("read src/lib.rs");
        let roots = root_names(&lib);
        let mut files = Vec::new();
        rs_files(src, &mut files);
        let mut graph: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
        for file in files {
            let rel = file.strip_prefix(src).expect("under src/");
            let parts: Vec<String> = rel
                .iter()
                .map(|p| p.to_string_lossy().into_owned())
                .collect();
            // The binary is a crate of its own; this file names every module.
            if parts[0] == "bin" || parts[0] == "lib.rs" || parts[0] == "layers.rs" {
                continue;
            }
            let top = parts[0].trim_end_matches(".rs").to_owned();
            let last = parts.last().map(String::as_str);
            let depth = parts.len() - usize::from(last == Some("mod.rs"));
            let source = std::fs::read_to_string(&file).expect("read a source file");
            let mut uses = imports(&code_of(&source), depth, &roots);
            uses.remove(&top);
            graph.entry(top).or_default().extend(uses);
        }
        graph
    }

    /// `(from, to)` for every import that points up a layer, or both ways within one.
    fn violations(graph: &BTreeMap<String, BTreeSet<String>>) -> BTreeSet<(String, String)> {
        let mut bad = BTreeSet::new();
        for (from, tos) in graph {
            for to in tos {
                let (Some(lf), Some(lt)) = (layer_of(from), layer_of(to)) else {
                    continue;
                };
                let back = graph.get(to).is_some_and(|t| t.contains(from));
                if lt > lf || (lt == lf && back) {
                    bad.insert((from.clone(), to.clone()));
                }
            }
        }
        bad
    }

    #[test]
    fn every_import_points_down_a_layer() {
        let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
        let graph = graph(&src);
        let unplaced: Vec<_> = graph.keys().filter(|m| layer_of(m).is_none()).collect();
        assert!(
            unplaced.is_empty(),
            "top-level modules missing from layers::LAYERS: {unplaced:?}"
        );
        let found = violations(&graph);
        assert!(
            found.is_empty(),
            "imports that point up a layer or both ways (ARCHITECTURE.md): {found:?}"
        );
    }

    #[test]
    fn the_check_sees_each_form_of_import() {
        let roots = root_names("pub use executor::{Context, Idempotency};\npub use store::Store;");
        let cases = [
            ("use crate::workflow::Step;", 2, "workflow"),
            ("use crate::{error::Error, sweeper::{A, B}};", 2, "sweeper"),
            ("let x = crate::axum::IdempotencyLayer::new();", 1, "axum"),
            ("use crate::Idempotency;", 2, "executor"),
            ("use super::super::super::sweeper::Sweeper;", 3, "sweeper"),
        ];
        for (code, depth, module) in cases {
            assert!(
                imports(code, depth, &roots).contains(module),
                "{code:?} names {module}"
            );
        }
        // Comments, climbs that stay inside the module, and test modules are not imports.
        assert!(imports(&code_of("// crate::sweeper::x"), 1, &roots).is_empty());
        assert!(imports("use super::super::decide;", 3, &roots).is_empty());
        let test_module = "fn f() {}\n#[cfg(test)]\nmod tests {\n    use crate::sweeper::X;\n}\n";
        assert!(imports(&code_of(test_module), 1, &roots).is_empty());
    }

    #[test]
    fn a_planted_reverse_import_is_refused() {
        // store (a lower layer) importing the sweeper, and the domain importing the store.
        let mut graph = graph(&Path::new(env!("CARGO_MANIFEST_DIR")).join("src"));
        graph
            .get_mut("store")
            .expect("src/store")
            .insert("sweeper".to_owned());
        graph
            .get_mut("state")
            .expect("src/state.rs")
            .insert("store".to_owned());
        let found = violations(&graph);
        assert!(found.contains(&("store".to_owned(), "sweeper".to_owned())));
        assert!(found.contains(&("state".to_owned(), "store".to_owned())));
    }
}

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

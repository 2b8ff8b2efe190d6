//! Imports run one way (docs/architecture.md): each top-level module of src/ may name only
//! modules of lower layers (and itself). Read from the source text: every `crate::<module>`
//! path, including those inside `use crate::{...}` groups.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

/// The layers, lowest first. A module may use the modules of lower layers only.
const LAYERS: &[&[&str]] = &[
    &["dtype", "error", "hashing", "probe"],
    &["message", "store"],
    &["config", "elementwise"],
    &["transport"],
    &["compress"],
    &["fusion"],
    &["collective", "negotiate"],
    &["runtime", "sim"],
    &["capi"],
];

fn layer(module: &str) -> Option<usize> {
    LAYERS.iter().position(|l| l.contains(&module))
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// The top-level modules a source text names through `crate::`.
fn named_modules(text: &str) -> BTreeSet<String> {
    let mut found = BTreeSet::new();
    let ident = |s: &str| -> String {
        s.chars()
            .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
            .collect()
    };
    for (i, _) in text.match_indices("crate::") {
        let rest = &text[i + "crate::".len()..];
        if let Some(group) = rest.strip_prefix('{') {
            let end = group.find('}').unwrap_or(group.len());
            for part in group[..end].split(',') {
                let name = ident(part.trim());
                if !name.is_empty() {
                    found.insert(name);
                }
            }
        } else {
            let name = ident(rest);
            if !name.is_empty() {
                found.insert(name);
            }
        }
    }
    found
}

#[test]
fn named_modules_are_read_from_paths_and_groups() {
    let text = "use crate::message::Response;\nuse crate::{dtype::DataType, error::Result};\n\
                let x = crate::probe::mark(\"a\", 1);";
    let got: Vec<String> = named_modules(text).into_iter().collect();
    assert_eq!(got, ["dtype", "error", "message", "probe"]);
}

#[test]
fn every_module_uses_only_lower_layers() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    rust_files(&src, &mut files);
    let mut wrong = Vec::new();
    for file in &files {
        let rel = file.strip_prefix(&src).unwrap();
        let first = rel
            .components()
            .next()
            .unwrap()
            .as_os_str()
            .to_string_lossy();
        let module = first.trim_end_matches(".rs").to_string();
        if module == "lib" || module == "bin" {
            continue;
        }
        let Some(mine) = layer(&module) else {
            wrong.push(format!("{}: module {module} has no layer", rel.display()));
            continue;
        };
        let text = std::fs::read_to_string(file).unwrap();
        for used in named_modules(&text) {
            if used == module {
                continue;
            }
            match layer(&used) {
                Some(l) if l < mine => {}
                _ => wrong.push(format!("{}: {module} uses {used}", rel.display())),
            }
        }
    }
    assert!(
        wrong.is_empty(),
        "imports against the layers:\n{}",
        wrong.join("\n")
    );
}

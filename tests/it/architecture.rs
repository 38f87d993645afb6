//! The library's modules depend on each other one way (README, "Layout"): no cycle among its files. A file
//! depends on the modules it names (`crate::a::b`, `super::c`), resolved to the deepest file that exists; a
//! module's own submodules are part of it, so a room naming its parent is not an edge. Test code
//! (`#[cfg(test)]` and after) is left out.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

type Module = Vec<String>;

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            if path.file_name().is_some_and(|n| n != "bin") {
                rust_files(&path, out);
            }
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// `src/pg/replication/mod.rs` → `[pg, replication]`; `src/lib.rs` → `[]`.
fn module_of(src: &Path, file: &Path) -> Module {
    let relative = file.strip_prefix(src).unwrap().with_extension("");
    let mut parts: Module = relative
        .components()
        .map(|c| c.as_os_str().to_string_lossy().into_owned())
        .collect();
    if parts.last().is_some_and(|p| p == "mod" || p == "lib") {
        parts.pop();
    }
    parts
}

/// Paths named after `prefix` (`crate::` or `super::`), as segments; a `use prefix{a, b::{c, d}}` tree
/// names each of its leaves.
fn named_paths(code: &str, prefix: &str) -> Vec<Module> {
    let mut paths = Vec::new();
    let mut rest = code;
    while let Some(at) = rest.find(prefix) {
        let preceded_by_word = rest[..at]
            .chars()
            .next_back()
            .is_some_and(|c| c.is_alphanumeric() || c == '_');
        rest = &rest[at + prefix.len()..];
        if !preceded_by_word {
            use_tree(&mut rest, Vec::new(), &mut paths);
        }
    }
    paths
}

/// Reads one use tree from the start of `text` (advancing it), below `base`.
fn use_tree(text: &mut &str, base: Module, out: &mut Vec<Module>) {
    let mut path = base;
    loop {
        if let Some(group) = text.strip_prefix('{') {
            *text = group;
            loop {
                *text = text.trim_start();
                if let Some(after) = text.strip_prefix('}') {
                    *text = after;
                    return;
                }
                if text.is_empty() {
                    return;
                }
                use_tree(text, path.clone(), out);
                *text = text.trim_start().trim_start_matches(',');
            }
        }
        let end = text
            .find(|c: char| !(c.is_alphanumeric() || c == '_'))
            .unwrap_or(text.len());
        if end > 0 && &text[..end] != "self" {
            path.push(text[..end].to_string());
        }
        *text = &text[end..];
        match text.strip_prefix("::") {
            Some(after) => *text = after,
            None => {
                out.push(path);
                return;
            }
        }
    }
}

fn dependencies() -> BTreeMap<Module, BTreeSet<Module>> {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    rust_files(&src, &mut files);
    files.retain(|f| f.file_name().is_some_and(|n| n != "main.rs"));
    let modules: BTreeMap<Module, PathBuf> = files
        .iter()
        .map(|f| (module_of(&src, f), f.clone()))
        .collect();
    let resolve = |path: &Module| -> Module {
        (0..=path.len())
            .rev()
            .map(|n| path[..n].to_vec())
            .find(|prefix| modules.contains_key(prefix))
            .unwrap_or_default()
    };
    let mut edges: BTreeMap<Module, BTreeSet<Module>> = BTreeMap::new();
    for (module, file) in &modules {
        let text = std::fs::read_to_string(file).unwrap();
        let code = text.split("#[cfg(test)]").next().unwrap_or_default();
        let parent: Module = module[..module.len().saturating_sub(1)].to_vec();
        let mut named = named_paths(code, "crate::");
        for path in named_paths(code, "super::") {
            named.push(parent.iter().cloned().chain(path).collect());
        }
        for path in named {
            let target = resolve(&path);
            // Itself, or a module it is part of.
            if module.starts_with(&target) {
                continue;
            }
            edges.entry(module.clone()).or_default().insert(target);
        }
    }
    edges
}

/// A cycle through `start`, if any (depth-first search).
fn cycle_from(
    edges: &BTreeMap<Module, BTreeSet<Module>>,
    start: &Module,
    path: &mut Vec<Module>,
) -> Option<Vec<Module>> {
    for next in edges.get(path.last().unwrap()).into_iter().flatten() {
        if next == start {
            return Some(path.clone());
        }
        if !path.contains(next) && next > start {
            path.push(next.clone());
            if let Some(cycle) = cycle_from(edges, start, path) {
                return Some(cycle);
            }
            path.pop();
        }
    }
    None
}

#[test]
fn the_library_has_no_module_cycle() {
    let edges = dependencies();
    assert!(
        edges.len() > 20,
        "the scan found too few modules to mean anything: {edges:?}"
    );
    for start in edges.keys() {
        if let Some(cycle) = cycle_from(&edges, start, &mut vec![start.clone()]) {
            let names: Vec<String> = cycle.iter().map(|m| m.join("::")).collect();
            panic!(
                "module cycle: {} -> (back to the first)",
                names.join(" -> ")
            );
        }
    }
}

#[test]
fn the_scan_sees_crate_and_super_paths_and_use_trees() {
    let code = "use crate::{config::RunSettings, pg::{self, slot}};\nuse super::gate::Gate;\nlet x = crate::lsn::Lsn(1); notcrate::x;";
    let names =
        |paths: Vec<Module>| -> Vec<String> { paths.iter().map(|p| p.join("::")).collect() };
    assert_eq!(
        names(named_paths(code, "crate::")),
        ["config::RunSettings", "pg", "pg::slot", "lsn::Lsn"]
    );
    assert_eq!(names(named_paths(code, "super::")), ["gate::Gate"]);
}

//! Records the git revision the extension is built from (`build_info()["git_revision"]`,
//! `kt version`): `git rev-parse` at build time, `+dirty` for uncommitted changes, `unknown`
//! outside a git checkout (an sdist) or without git.
use std::process::Command;

fn git(args: &[&str]) -> Option<String> {
    let out = Command::new("git").args(args).output().ok()?;
    out.status
        .success()
        .then(|| String::from_utf8_lossy(&out.stdout).trim().to_string())
}

/// Whether git's work tree is this workspace (not an enclosing repository that happens to hold
/// an unpacked sdist).
fn in_own_checkout() -> bool {
    let workspace = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    match (
        git(&["rev-parse", "--show-toplevel"]),
        workspace.canonicalize(),
    ) {
        (Some(top), Ok(ws)) => std::path::Path::new(&top)
            .canonicalize()
            .is_ok_and(|t| t == ws),
        _ => false,
    }
}

fn main() {
    let head = if in_own_checkout() {
        git(&["rev-parse", "--short=12", "HEAD"])
    } else {
        None
    };
    let revision = match head {
        Some(rev) if !rev.is_empty() => {
            let dirty = git(&["status", "--porcelain", "--untracked-files=no"])
                .is_some_and(|s| !s.is_empty());
            format!("{rev}{}", if dirty { "+dirty" } else { "" })
        }
        _ => "unknown".to_string(),
    };
    println!("cargo:rustc-env=KT_GIT_REVISION={revision}");
    // Rebuild when HEAD moves or the index changes (a commit, a checkout, a staged edit).
    if let Some(dir) = git(&["rev-parse", "--absolute-git-dir"]) {
        println!("cargo:rerun-if-changed={dir}/HEAD");
        println!("cargo:rerun-if-changed={dir}/index");
        if let Some(head_ref) = git(&["symbolic-ref", "-q", "HEAD"]) {
            println!("cargo:rerun-if-changed={dir}/{head_ref}");
        }
    }
    println!("cargo:rerun-if-changed=build.rs");
}

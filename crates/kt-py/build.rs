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

fn main() {
    let revision = match git(&["rev-parse", "--short=12", "HEAD"]) {
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

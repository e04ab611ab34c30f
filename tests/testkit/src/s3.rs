//! A real S3-compatible server for the OBJECT tier's tests: `s3s-fs` (crates.io, installed by
//! `scripts/install-deps`), started on loopback over a directory of its own, with credentials.
//!
//! Without the binary a test prints `SKIPPED` and returns; `RIXL_REQUIRE_S3=1` (set by
//! `scripts/test-all`, so CI) makes that a failure.

use std::io::Write;
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

/// The access key the server accepts.
pub const ACCESS_KEY: &str = "rixl-test-access";
/// The secret key the server accepts.
pub const SECRET_KEY: &str = "rixl-test-secret-0123456789";

/// A running `s3s-fs` on `127.0.0.1`, killed and its directory removed on drop.
#[derive(Debug)]
pub struct S3Server {
    child: Option<Child>,
    exe: PathBuf,
    root: PathBuf,
    port: u16,
}

fn binary() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("RIXL_S3S_FS") {
        return Some(PathBuf::from(p));
    }
    let home = std::env::var_os("CARGO_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cargo")));
    let mut candidates: Vec<PathBuf> = home.into_iter().map(|h| h.join("bin/s3s-fs")).collect();
    if let Some(path) = std::env::var_os("PATH") {
        candidates.extend(std::env::split_paths(&path).map(|d| d.join("s3s-fs")));
    }
    candidates.into_iter().find(|p| p.is_file())
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free loopback port")
}

impl S3Server {
    /// Starts a server with bucket `bucket`, or prints why `test` is skipped and returns `None`.
    ///
    /// # Panics
    /// If the server cannot start, or is missing while `RIXL_REQUIRE_S3=1`.
    pub fn start(test: &str, bucket: &str) -> Option<S3Server> {
        let Some(exe) = binary() else {
            if std::env::var("RIXL_REQUIRE_S3").as_deref() == Ok("1") {
                panic!("{test}: s3s-fs required but not installed (scripts/install-deps)");
            }
            let _ = writeln!(
                std::io::stderr(),
                "SKIPPED {test}: no s3s-fs (cargo install s3s-fs --features binary, or scripts/install-deps)"
            );
            return None;
        };
        let root = std::env::temp_dir().join(format!(
            "rixl-s3-{}-{}-{}",
            test,
            std::process::id(),
            free_port()
        ));
        std::fs::create_dir_all(root.join(bucket)).expect("server root");
        let mut s = S3Server {
            child: None,
            exe,
            root,
            port: free_port(),
        };
        s.restart();
        Some(s)
    }

    /// The endpoint URL.
    pub fn endpoint(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    /// Where the server keeps its buckets (one directory each).
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// The server's process id (while it runs).
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// Kills the server (SIGKILL), as a crash would.
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Stops (`SIGSTOP`) or resumes (`SIGCONT`) the server: a server that hangs.
    pub fn pause(&self, paused: bool) {
        if let Some(pid) = self.pid() {
            let sig = if paused { "-STOP" } else { "-CONT" };
            let _ = Command::new("kill").arg(sig).arg(pid.to_string()).status();
        }
    }

    /// Starts the server again on the same port and directory (after [`Self::kill`]).
    ///
    /// # Panics
    /// If it does not listen within 20 s.
    pub fn restart(&mut self) {
        self.kill();
        let child = Command::new(&self.exe)
            .args(["--host", "127.0.0.1", "--port"])
            .arg(self.port.to_string())
            .args(["--access-key", ACCESS_KEY, "--secret-key", SECRET_KEY])
            .arg(&self.root)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start s3s-fs");
        self.child = Some(child);
        assert!(
            crate::wait_listening(&format!("127.0.0.1:{}", self.port), Duration::from_secs(20)),
            "s3s-fs did not listen on port {}",
            self.port
        );
    }
}

impl Drop for S3Server {
    fn drop(&mut self) {
        self.pause(false);
        self.kill();
        let _ = std::fs::remove_dir_all(&self.root);
    }
}

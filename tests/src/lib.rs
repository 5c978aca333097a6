//! shoal-tests: behaviour across crates, tested end to end.
//!
//! The tests live in `tests/tests/`: training outcomes on the built-in corpus, compression
//! through stage boundaries, and swarms of real `shoal` processes on loopback. This library
//! holds what those tests share: starting a `shoal node --control` process and talking to it.
//! It must never be a dependency of a shipped crate, and the tests assert outcomes a user
//! would care about (the loss fell, the peer recovered, the bytes match), never wall-clock
//! timings.

use serde_json::{Value, json};
use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::{OnceLock, mpsc};
use std::time::{Duration, Instant};

/// The `shoal` binary of this build, brought up to date once per test process (`cargo test
/// -p shoal-tests` alone would not rebuild it, and a stale binary tests old code), built with
/// the test-only `attacks` feature.
pub fn shoal_binary() -> PathBuf {
    static BINARY: OnceLock<PathBuf> = OnceLock::new();
    BINARY
        .get_or_init(|| {
            let exe = std::env::current_exe().expect("test executable path");
            // target/<profile>/deps/<test> -> target/<profile>/shoal
            let dir = exe
                .parent()
                .and_then(Path::parent)
                .expect("target directory");
            let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
            let mut cmd = Command::new(cargo);
            // With the test-only `attacks` feature: the attack tests start misbehaving peers
            // (`--behavior`); every other test starts honest ones of the same binary.
            cmd.args([
                "build",
                "--quiet",
                "-p",
                "shoal-node",
                "--bin",
                "shoal",
                "--features",
                "attacks",
            ]);
            if dir.file_name().is_some_and(|n| n == "release") {
                cmd.arg("--release");
            }
            let status = cmd.status().expect("run cargo build");
            assert!(status.success(), "building shoal failed");
            dir.join(format!("shoal{}", std::env::consts::EXE_SUFFIX))
        })
        .clone()
}

/// A command that runs the `shoal` binary, in network namespace `netns` where one is named
/// (`ip netns exec` execs it: the child is `shoal` itself).
fn shoal_command(netns: Option<&str>) -> Command {
    match netns {
        None => Command::new(shoal_binary()),
        Some(ns) => {
            let mut cmd = Command::new("ip");
            cmd.args(["netns", "exec", ns]).arg(shoal_binary());
            cmd
        }
    }
}

/// A `shoal node --control` process: commands go in as JSON lines, events come out.
pub struct NodeProcess {
    /// The node's PeerId.
    pub peer: String,
    /// Its first loopback listen address (with `/p2p/<id>`).
    pub addr: String,
    child: Child,
    stdin: ChildStdin,
    events: mpsc::Receiver<Value>,
    /// Every event received so far, in order.
    pub seen: Vec<Value>,
}

impl NodeProcess {
    /// Starts a node with a fresh identity in `dir` and `extra` flags, and waits until it
    /// listens on loopback.
    pub fn start(dir: &Path, name: &str, extra: &[&str]) -> NodeProcess {
        Self::start_in(None, dir, name, extra, "/ip4/127.")
    }

    /// Starts a node in network namespace `netns` (the host's where None) and waits until it
    /// listens on an address that contains `listening_on`.
    pub fn start_in(
        netns: Option<&str>,
        dir: &Path,
        name: &str,
        extra: &[&str],
        listening_on: &str,
    ) -> NodeProcess {
        let mut node = Self::spawn(netns, dir, name, extra);
        let listening = node.wait_for(Duration::from_secs(30), |e| {
            e["event"] == "listening"
                && e["addr"].as_str().is_some_and(|a| a.contains(listening_on))
        });
        node.addr = listening["addr"].as_str().expect("address").to_owned();
        node
    }

    /// Starts a node that listens on no address of its own (`--listen` is given a relay
    /// circuit later, or nothing).
    pub fn start_without_listen(dir: &Path, name: &str, extra: &[&str]) -> NodeProcess {
        Self::spawn(None, dir, name, &[&["--no-listen"], extra].concat())
    }

    fn spawn(netns: Option<&str>, dir: &Path, name: &str, extra: &[&str]) -> NodeProcess {
        let identity = dir.join(format!("{name}.key"));
        let mut child = shoal_command(netns)
            .args(["node", "--control", "--identity"])
            .arg(&identity)
            .args(extra)
            // Hostile-input tests make nodes warn a lot; SHOAL_TEST_LOG shows it when wanted.
            .env(
                "RUST_LOG",
                std::env::var("SHOAL_TEST_LOG").unwrap_or_else(|_| "error".into()),
            )
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("start shoal node");
        let stdin = child.stdin.take().expect("stdin");
        let stdout = child.stdout.take().expect("stdout");
        let (tx, events) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                if let Ok(v) = serde_json::from_str::<Value>(&line) {
                    if tx.send(v).is_err() {
                        break;
                    }
                }
            }
        });
        let mut node = NodeProcess {
            peer: String::new(),
            addr: String::new(),
            child,
            stdin,
            events,
            seen: Vec::new(),
        };
        let started = node.wait_for(Duration::from_secs(60), |e| e["event"] == "started");
        node.peer = started["peer"].as_str().expect("peer id").to_owned();
        node
    }

    /// Sends a command.
    pub fn send(&mut self, command: Value) {
        writeln!(self.stdin, "{command}").expect("write command");
        self.stdin.flush().expect("flush command");
    }

    /// Waits for the next event (new or already seen) matching `pred`; panics after `timeout`.
    pub fn wait_for(&mut self, timeout: Duration, pred: impl Fn(&Value) -> bool) -> Value {
        match wait_matching(&mut self.seen, &self.events, timeout, pred) {
            Ok(v) => v,
            Err(_) => panic!(
                "node {} ({}): no matching event within {timeout:?}; saw {:?}",
                self.peer,
                self.addr,
                self.seen.iter().rev().take(10).collect::<Vec<_>>()
            ),
        }
    }

    /// Collects every event that arrives within `window`.
    pub fn drain(&mut self, window: Duration) {
        let deadline = Instant::now() + window;
        while let Ok(v) = self
            .events
            .recv_timeout(deadline.saturating_duration_since(Instant::now()))
        {
            self.seen.push(v);
        }
    }

    /// Asks for a tensor of `values` values from `seed` to be sent to `peer`.
    pub fn send_tensor(&mut self, peer: &str, values: usize, seed: u64) {
        self.send(json!({"op": "send", "peer": peer, "values": values, "seed": seed}));
    }

    /// The operating system's id of the process.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Peak resident memory of the process so far, in bytes (Linux: `VmHWM`).
    pub fn peak_rss_bytes(&self) -> Option<u64> {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.pid())).ok()?;
        let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
        let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
        Some(kib * 1024)
    }

    /// Kills the process with SIGKILL.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// Whether the process is still running.
    pub fn is_running(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }
}

impl Drop for NodeProcess {
    fn drop(&mut self) {
        self.kill();
    }
}

/// A fresh temporary directory for one test.
pub fn temp_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("shoal-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("create temp dir");
    dir
}

/// Where a `shoal run` process logs: with `SHOAL_TEST_LOG` set, to `dir/<name>.log` (appended
/// to, so a restarted peer's log follows its first life), else to the test's own stderr.
fn log_to(dir: &Path, name: &str) -> Stdio {
    if std::env::var_os("SHOAL_TEST_LOG").is_none() {
        return Stdio::inherit();
    }
    std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(dir.join(format!("{name}.log")))
        .map_or_else(|_| Stdio::inherit(), Stdio::from)
}

/// A `shoal run` process: one peer of a training run, observed through its output lines.
pub struct RunProcess {
    /// A name for messages.
    pub name: String,
    /// Where it writes its JSON report on exit.
    pub report: PathBuf,
    child: Child,
    lines: mpsc::Receiver<String>,
    /// Every output line so far.
    pub seen: Vec<String>,
}

impl RunProcess {
    /// Starts `shoal run` with identity `dir/<name>.key`, report `dir/<name>.json` and `args`.
    pub fn start(dir: &Path, name: &str, args: &[&str]) -> RunProcess {
        Self::start_in(None, dir, name, args)
    }

    /// [`RunProcess::start`] in network namespace `netns` (the host's where None).
    pub fn start_in(netns: Option<&str>, dir: &Path, name: &str, args: &[&str]) -> RunProcess {
        let report = dir.join(format!("{name}.json"));
        let _ = std::fs::remove_file(&report);
        let mut child = shoal_command(netns)
            .arg("run")
            .arg("--identity")
            .arg(dir.join(format!("{name}.key")))
            .arg("--report")
            .arg(&report)
            .args(args)
            .env(
                "RUST_LOG",
                std::env::var("SHOAL_TEST_LOG").unwrap_or_else(|_| "error".into()),
            )
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(log_to(dir, name))
            .spawn()
            .expect("start shoal run");
        let stdout = child.stdout.take().expect("stdout");
        let (tx, lines) = mpsc::channel();
        let label = name.to_owned();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                if std::env::var_os("SHOAL_TEST_ECHO").is_some() {
                    eprintln!("[{label}] {line}");
                }
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        RunProcess {
            name: name.to_owned(),
            report,
            child,
            lines,
            seen: Vec::new(),
        }
    }

    /// Waits for an output line (new or already seen) matching `pred`; panics after
    /// `timeout` or if the process exits first.
    pub fn wait_line(&mut self, timeout: Duration, pred: impl Fn(&str) -> bool) -> String {
        match wait_matching(&mut self.seen, &self.lines, timeout, |l: &String| pred(l)) {
            Ok(l) => l,
            Err(e) => panic!(
                "{}: no matching line within {timeout:?} ({e}); last lines: {:?}",
                self.name,
                self.seen.iter().rev().take(8).collect::<Vec<_>>()
            ),
        }
    }

    /// The run id and bootstrap address of the first "others join with" line it printed
    /// whose address satisfies `pred`; panics after `timeout`.
    pub fn join_command(
        &mut self,
        timeout: Duration,
        pred: impl Fn(&str) -> bool,
    ) -> (String, String) {
        let join = self.wait_line(timeout, |l| l.contains("--bootstrap") && pred(l));
        let words: Vec<&str> = join.split_whitespace().collect();
        let after = |flag: &str| {
            let at = words.iter().position(|w| *w == flag).expect("a join line");
            words[at + 1].to_owned()
        };
        (after("--run"), after("--bootstrap"))
    }

    /// Moves the lines that have arrived into `seen`.
    fn take_lines(&mut self) {
        while let Ok(l) = self.lines.try_recv() {
            self.seen.push(l);
        }
    }

    /// The highest step shown in its progress lines so far (reads what has arrived).
    pub fn step(&mut self) -> u64 {
        self.take_lines();
        self.seen
            .iter()
            .filter_map(|l| l.split("step ").nth(1))
            .filter_map(|rest| rest.split('/').next()?.trim().parse::<u64>().ok())
            .max()
            .unwrap_or(0)
    }

    /// Waits until its progress shows `step` or more.
    pub fn wait_step(&mut self, step: u64, timeout: Duration) {
        let deadline = Instant::now() + timeout;
        while self.step() < step {
            assert!(
                Instant::now() < deadline,
                "{}: step {} not reached within {timeout:?}; last lines: {:?}",
                self.name,
                step,
                self.seen.iter().rev().take(8).collect::<Vec<_>>()
            );
            assert!(self.is_running(), "{} exited early", self.name);
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    /// Asks the process to stop with SIGTERM, as `kill`, docker and systemd do.
    #[cfg(unix)]
    pub fn terminate(&mut self) {
        let pid = libc::pid_t::try_from(self.child.id()).expect("a pid");
        // SAFETY: kill(2) with a pid this test started and has not reaped yet.
        let sent = unsafe { libc::kill(pid, libc::SIGTERM) };
        assert_eq!(sent, 0, "{}: SIGTERM not sent", self.name);
    }

    /// Kills the process with SIGKILL (no checkpoint, no goodbye).
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// Whether the process is still running.
    pub fn is_running(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }

    /// Waits for the process to exit by itself and returns its report.
    pub fn finish(&mut self, timeout: Duration) -> Value {
        self.wait_exit(timeout);
        self.report()
    }

    /// Waits for the process to exit by itself; its exit status.
    pub fn wait_exit(&mut self, timeout: Duration) -> std::process::ExitStatus {
        let deadline = Instant::now() + timeout;
        loop {
            if let Ok(Some(status)) = self.child.try_wait() {
                self.take_lines();
                return status;
            }
            self.take_lines();
            assert!(
                Instant::now() < deadline,
                "{} did not finish within {timeout:?}; last lines: {:?}",
                self.name,
                self.seen.iter().rev().take(8).collect::<Vec<_>>()
            );
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    /// The JSON report it wrote on exit.
    pub fn report(&self) -> Value {
        let text = std::fs::read_to_string(&self.report)
            .unwrap_or_else(|e| panic!("{}: no report ({e}); output: {:?}", self.name, self.seen));
        serde_json::from_str(&text).expect("report is JSON")
    }
}

impl Drop for RunProcess {
    fn drop(&mut self) {
        self.kill();
    }
}

/// The body of `GET /metrics` at `url` (`http://HOST:PORT/metrics`, as a peer prints it).
pub fn scrape(url: &str) -> String {
    use std::io::Read;
    let rest = url.strip_prefix("http://").expect("an http:// url");
    let (host, path) = rest.split_once('/').expect("a path");
    let mut stream = std::net::TcpStream::connect(host).expect("connect to the metrics endpoint");
    stream
        .set_read_timeout(Some(Duration::from_secs(10)))
        .expect("timeout");
    write!(stream, "GET /{path} HTTP/1.1\r\nhost: {host}\r\n\r\n").expect("request");
    let mut response = String::new();
    stream.read_to_string(&mut response).expect("response");
    let (head, body) = response.split_once("\r\n\r\n").expect("an HTTP response");
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    body.to_owned()
}

/// The value of the sample `name` (with its labels, as printed) in a metrics text.
pub fn metric(text: &str, name: &str) -> Option<f64> {
    text.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.parse().ok())
}

/// The first item (already `seen`, or arriving on `rx` within `timeout`, which is then kept in
/// `seen`) that matches `pred`.
fn wait_matching<T: Clone>(
    seen: &mut Vec<T>,
    rx: &mpsc::Receiver<T>,
    timeout: Duration,
    pred: impl Fn(&T) -> bool,
) -> Result<T, mpsc::RecvTimeoutError> {
    if let Some(v) = seen.iter().find(|v| pred(v)) {
        return Ok(v.clone());
    }
    let deadline = Instant::now() + timeout;
    loop {
        let v = rx.recv_timeout(deadline.saturating_duration_since(Instant::now()))?;
        seen.push(v.clone());
        if pred(&v) {
            return Ok(v);
        }
    }
}

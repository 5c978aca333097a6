//! The live dashboard of a real run, opened in headless Chromium (Debian's `chromium`; the
//! README's test command installs it): three peers train, the page of one of them lists
//! every peer by stage and draws the loss curve from the server-sent events, and a
//! screenshot is saved as the test's artifact (`target/artifacts/dashboard.png`).
//!
//! The browser is driven over the DevTools protocol, as Puppeteer does: one WebSocket to the
//! browser, a page attached to it as a flat session, `Runtime.evaluate` to read the DOM.

#![allow(clippy::unwrap_used, missing_docs)]

use base64::Engine;
use serde_json::{Value, json};
use shoal_tests::{RunProcess, temp_dir};
use std::io::{BufRead, BufReader};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};
use tungstenite::{Message, WebSocket};

const LONG: Duration = Duration::from_secs(600);

/// Headless Chromium under the DevTools protocol.
struct Browser {
    child: Child,
    socket: WebSocket<TcpStream>,
    next_id: u64,
    session: Option<String>,
}

impl Browser {
    fn start(profile: &Path) -> Browser {
        let binary = std::env::var("SHOAL_CHROMIUM").unwrap_or_else(|_| "chromium".into());
        let mut child = Command::new(&binary)
            .args([
                "--headless",
                "--no-sandbox",
                "--disable-gpu",
                "--hide-scrollbars",
                "--no-first-run",
                "--window-size=1280,1100",
                "--remote-debugging-port=0",
            ])
            .arg(format!("--user-data-dir={}", profile.display()))
            .arg("about:blank")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap_or_else(|e| {
                panic!(
                    "cannot start {binary} ({e}): the dashboard test needs Debian's chromium \
                     package (the README's test command installs it), or SHOAL_CHROMIUM"
                )
            });
        let stderr = BufReader::new(child.stderr.take().unwrap());
        let mut url = None;
        for line in stderr.lines() {
            let line = line.unwrap();
            if let Some(at) = line.find("ws://") {
                url = Some(line[at..].trim().to_owned());
                break;
            }
        }
        let url = url.expect("Chromium printed no DevTools address");
        let rest = url.strip_prefix("ws://").unwrap();
        let host = rest.split('/').next().unwrap();
        let stream = TcpStream::connect(host).unwrap();
        stream
            .set_read_timeout(Some(Duration::from_secs(30)))
            .unwrap();
        let (socket, _) = tungstenite::client(url.as_str(), stream).unwrap();
        Browser {
            child,
            socket,
            next_id: 1,
            session: None,
        }
    }

    /// Sends a command (to the attached page where there is one) and waits for its result.
    fn call(&mut self, method: &str, params: Value) -> Value {
        let id = self.next_id;
        self.next_id += 1;
        let mut msg = json!({"id": id, "method": method, "params": params});
        if let Some(s) = &self.session {
            msg["sessionId"] = json!(s);
        }
        self.socket.send(Message::text(msg.to_string())).unwrap();
        loop {
            let Message::Text(text) = self.socket.read().unwrap() else {
                continue;
            };
            let reply: Value = serde_json::from_str(text.as_str()).unwrap();
            if reply["id"] == json!(id) {
                assert!(reply.get("error").is_none(), "{method}: {reply}");
                return reply["result"].clone();
            }
        }
    }

    /// Opens `url` in a new page and attaches to it.
    fn open(&mut self, url: &str) {
        let target = self.call("Target.createTarget", json!({"url": url}));
        let attached = self.call(
            "Target.attachToTarget",
            json!({"targetId": target["targetId"], "flatten": true}),
        );
        self.session = Some(attached["sessionId"].as_str().unwrap().to_owned());
    }

    /// The value of a JavaScript expression in the page.
    fn eval(&mut self, expression: &str) -> Value {
        let r = self.call(
            "Runtime.evaluate",
            json!({"expression": expression, "returnByValue": true}),
        );
        r["result"]["value"].clone()
    }

    fn screenshot(&mut self, path: &Path) {
        let shot = self.call("Page.captureScreenshot", json!({"format": "png"}));
        let png = base64::engine::general_purpose::STANDARD
            .decode(shot["data"].as_str().unwrap())
            .unwrap();
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(path, png).unwrap();
    }
}

impl Drop for Browser {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn artifacts() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../target/artifacts")
        .to_path_buf()
}

#[test]
fn the_dashboard_shows_every_peer_and_the_loss_curve_live() {
    let dir = temp_dir("dashboard");
    let common = [
        "--listen",
        "/ip4/127.0.0.1/udp/0/quic-v1",
        "--no-mdns",
        "--threads",
        "1",
    ];
    let mut creator_args: Vec<&str> = common.to_vec();
    creator_args.extend([
        "--preset",
        "nano",
        "--stages",
        "2",
        "--global-batch",
        "8",
        "--microbatch",
        "4",
        "--seq",
        "32",
        "--max-steps",
        "100000",
        "--stage",
        "0",
        "--dashboard",
        "127.0.0.1:0",
    ]);
    let mut peers = vec![RunProcess::start(&dir, "p0", &creator_args)];
    let (run_id, boot) = peers[0].join_command(LONG, |_| true);
    for name in ["p1", "p2"] {
        let mut args = common.to_vec();
        args.extend(["--run", &run_id, "--bootstrap", &boot, "--stage", "1"]);
        peers.push(RunProcess::start(&dir, name, &args));
    }
    let line = peers[0].wait_line(LONG, |l| l.starts_with("dashboard on http://"));
    let url = line.trim_start_matches("dashboard on ").to_owned();
    let ids: Vec<String> = peers
        .iter_mut()
        .map(|p| {
            let line = p.wait_line(LONG, |l| l.starts_with("shoal run "));
            line.rsplit("peer ").next().unwrap().trim().to_owned()
        })
        .collect();
    for p in &mut peers {
        p.wait_step(3, LONG);
    }

    let mut browser = Browser::start(&dir.join("chromium"));
    browser.open(&url);
    let probe = r##"JSON.stringify({
        peers: [...document.querySelectorAll("[data-peer]")].map((e) => e.dataset.peer),
        stages: document.querySelectorAll(".stage").length,
        loss: Number(document.querySelector("#loss-chart polyline")?.dataset.points ?? 0),
        throughput: Number(document.querySelector("#throughput-chart polyline")?.dataset.points ?? 0),
        status: document.getElementById("status").textContent,
        events: document.querySelectorAll("#events li").length,
    })"##;
    let deadline = Instant::now() + Duration::from_secs(120);
    let seen = loop {
        // Null while the page is still loading.
        let seen: Value = browser
            .eval(probe)
            .as_str()
            .map_or(json!({"peers": [], "loss": 0, "throughput": 0}), |s| {
                serde_json::from_str(s).unwrap()
            });
        let listed = |id: &String| seen["peers"].as_array().unwrap().contains(&json!(id));
        if ids.iter().all(listed)
            && seen["loss"].as_u64().unwrap() >= 3
            && seen["throughput"].as_u64().unwrap() >= 3
        {
            break seen;
        }
        assert!(
            Instant::now() < deadline,
            "the page never showed every peer and the curves: {seen}"
        );
        std::thread::sleep(Duration::from_millis(500));
    };
    assert_eq!(seen["stages"], 2, "{seen}");
    assert!(
        seen["status"].as_str().unwrap().starts_with("live"),
        "{seen}"
    );
    assert!(seen["events"].as_u64().unwrap() >= 1, "{seen}");
    // Live: the curve grows while the page stays open, without a reload.
    let before = seen["loss"].as_u64().unwrap();
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let now: Value = serde_json::from_str(browser.eval(probe).as_str().unwrap()).unwrap();
        if now["loss"].as_u64().unwrap() > before {
            break;
        }
        assert!(Instant::now() < deadline, "the loss curve stopped: {now}");
        std::thread::sleep(Duration::from_millis(500));
    }
    // SHOAL_DASHBOARD_LINGER=S lets the curves grow S seconds more before the screenshot
    // (how the README's was taken).
    if let Some(s) = std::env::var("SHOAL_DASHBOARD_LINGER")
        .ok()
        .and_then(|s| s.parse().ok())
    {
        std::thread::sleep(Duration::from_secs(s));
    }
    browser.screenshot(&artifacts().join("dashboard.png"));
}

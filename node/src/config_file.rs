//! `--config FILE`: a subcommand's flags as TOML keys. Every flag has a key, named as the
//! flag without its dashes (`global-batch` or `global_batch`); values are strings, numbers,
//! booleans (a switch: `true` sets it) or arrays (a repeatable flag). Flags given on the
//! command line override the file's keys. The keys become flags before clap parses anything,
//! so a file says nothing the command line could not, and clap checks both alike.

use anyhow::{Context, bail};
use clap::CommandFactory;
use std::ffi::OsString;
use std::path::Path;

/// `argv` with `--config FILE` replaced by the file's keys as flags, placed right after the
/// subcommand so that the command line's own flags, and clap's errors, read as usual.
pub fn expand(argv: Vec<OsString>) -> anyhow::Result<Vec<OsString>> {
    let Some(at) = argv
        .iter()
        .position(|a| a == "--config" || a.to_string_lossy().starts_with("--config="))
    else {
        return Ok(argv);
    };
    let (path, taken) = match argv[at].to_string_lossy().strip_prefix("--config=") {
        Some(p) => (OsString::from(p), 1),
        None => match argv.get(at + 1) {
            Some(p) => (p.clone(), 2),
            None => bail!("--config needs a file"),
        },
    };
    let mut rest: Vec<OsString> = argv[..at].to_vec();
    rest.extend(argv[at + taken..].iter().cloned());
    // The subcommand path (`run`, `bench compute`) and the flags its command knows.
    let mut command = crate::cli::Cli::command();
    // Built, so that global flags (`--log-format`) are among each subcommand's.
    command.build();
    let mut after = 1;
    while let Some(name) = rest.get(after).and_then(|a| a.to_str()) {
        match command.find_subcommand(name) {
            Some(sub) => {
                command = sub.clone();
                after += 1;
            }
            None => break,
        }
    }
    let path = Path::new(&path);
    let text =
        std::fs::read_to_string(path).with_context(|| format!("cannot read {}", path.display()))?;
    let flags =
        flags_of(&text, &command, &rest[after..]).with_context(|| format!("{}", path.display()))?;
    let mut out = rest[..after].to_vec();
    out.extend(flags);
    out.extend(rest[after..].iter().cloned());
    Ok(out)
}

/// The flags the TOML document `text` stands for, for `command`, leaving out those that
/// `given` (the command line) sets itself.
fn flags_of(
    text: &str,
    command: &clap::Command,
    given: &[OsString],
) -> anyhow::Result<Vec<OsString>> {
    let table: toml::Table = toml::from_str(text).context("not a TOML table of flags")?;
    let longs: Vec<&str> = command
        .get_arguments()
        .filter_map(|a| a.get_long())
        .collect();
    let mut flags = Vec::new();
    for (key, value) in &table {
        let long = key.replace('_', "-");
        if long == "config" || !longs.contains(&long.as_str()) {
            bail!(
                "unknown key `{key}`: `shoal {}` has no flag --{long}",
                command.get_name()
            );
        }
        let flag = format!("--{long}");
        let on_command_line = given.iter().any(|a| {
            a.to_str().is_some_and(|a| {
                a == flag || a.strip_prefix(&flag).is_some_and(|r| r.starts_with('='))
            })
        });
        if on_command_line {
            continue;
        }
        let values = match value {
            toml::Value::Array(items) => items.iter().collect(),
            _ => vec![value],
        };
        for v in values {
            let text = match v {
                toml::Value::String(s) => s.clone(),
                toml::Value::Integer(i) => i.to_string(),
                toml::Value::Float(f) => f.to_string(),
                toml::Value::Boolean(true) => {
                    flags.push(OsString::from(&flag));
                    continue;
                }
                toml::Value::Boolean(false) => continue,
                _ => bail!("key `{key}`: a string, number, boolean or array of them"),
            };
            flags.push(OsString::from(format!("{flag}={text}")));
        }
    }
    Ok(flags)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cli::{Cli, Command};
    use clap::Parser;

    fn parse(argv: &[&str], file: &str) -> anyhow::Result<crate::cli::RunArgs> {
        let dir = std::env::temp_dir().join(format!("shoal-config-{}", std::process::id()));
        std::fs::create_dir_all(&dir)?;
        let path = dir.join(format!(
            "{:x}.toml",
            xxhash_rust::xxh3::xxh3_64(file.as_bytes())
        ));
        std::fs::write(&path, file)?;
        let mut args: Vec<OsString> = ["shoal", "run", "--config"].map(OsString::from).to_vec();
        args.push(path.into_os_string());
        args.extend(argv.iter().map(OsString::from));
        let cli = Cli::try_parse_from(expand(args)?)?;
        match cli.command {
            Command::Run(a) => Ok(*a),
            _ => bail!("not run"),
        }
    }

    #[test]
    fn a_files_keys_are_flags_and_the_command_line_overrides_them() {
        let file = r#"
            preset = "micro"
            stages = 3
            global_batch = 64
            lr = 0.0005
            recompute = true
            no-mdns = false
            bootstrap = ["/ip4/10.0.0.1/udp/4001/quic-v1", "/ip4/10.0.0.2/udp/4001/quic-v1"]
        "#;
        let a = parse(&[], file).unwrap();
        assert_eq!(a.preset.name(), "micro");
        assert_eq!((a.stages, a.global_batch, a.lr), (3, 64, Some(0.0005)));
        assert!(a.recompute && !a.no_mdns);
        assert_eq!(a.bootstrap.len(), 2);
        // A flag beats its key, lists included (they replace, not extend).
        let a = parse(
            &["--stages", "2", "--bootstrap=/ip4/10.0.0.3/udp/1/quic-v1"],
            file,
        )
        .unwrap();
        assert_eq!((a.stages, a.global_batch), (2, 64));
        assert_eq!(a.bootstrap.len(), 1);
    }

    #[test]
    fn a_bad_file_says_which_key_and_why() {
        let e = format!("{:#}", parse(&[], "stagez = 3").unwrap_err());
        assert!(
            e.contains("unknown key `stagez`") && e.contains("--stagez"),
            "{e}"
        );
        let e = format!("{:#}", parse(&[], "[stages]\nx = 1").unwrap_err());
        assert!(e.contains("key `stages`"), "{e}");
        let e = format!("{:#}", parse(&[], "stages = ").unwrap_err());
        assert!(e.contains("not a TOML table"), "{e}");
        // Values are checked by the flags' own parsers.
        let e = format!("{:#}", parse(&[], "stages = 0").unwrap_err());
        assert!(e.contains("--stages"), "{e}");
    }
}

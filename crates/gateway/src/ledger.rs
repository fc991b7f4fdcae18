//! The `--ack fast` ledger's file, written by the control plane and by the data plane's
//! direct lane through one appender.
//!
//! The control plane keeps the ledger (`rollout_store/serve/ack_ledger.py`: what its lines
//! mean, the counts it reads back, when it rewrites them); every line, its own and the
//! lane's, goes to the file through this one [`Ledger`]: one descriptor, one lock, one
//! `write` a line (a killed process leaves whole lines). The lane writes `a SID` before it
//! replies to a call, with no Python on the way; the control plane learns of that line when
//! the recorder hands it the call ([`Ledger::applied`]). A rewrite holds the control plane's
//! counts, so the lane's lines it does not know yet are appended to the rewritten file
//! before it is put in place ([`Ledger::replace`]): a rewrite never waits for the lane.

use std::collections::VecDeque;
use std::fs::{File, OpenOptions};
use std::io::{self, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

/// The ledger's file mode: it names sessions, readable by its owner only.
const FILE_MODE: u32 = 0o600;

#[derive(Debug, Default)]
struct State {
    file: Option<File>,
    /// `a` lines the lane wrote that the control plane does not know yet, oldest first.
    unapplied: VecDeque<Unapplied>,
    /// The number of the lane's last line.
    last: u64,
}

/// A line of the lane the control plane does not know yet: its number (what the control
/// plane names it by in [`Ledger::applied`]), its session, and that session's `alive` flag.
#[derive(Debug)]
struct Unapplied {
    entry: u64,
    session: Box<str>,
    alive: Arc<AtomicBool>,
}

/// The appender of one ledger file (see the module).
#[derive(Debug, Default)]
pub struct Ledger {
    state: Mutex<State>,
}

/// What [`Ledger::answered`] did.
#[derive(Debug, PartialEq, Eq)]
pub enum Answered {
    /// The line is written: its number, for [`Ledger::applied`].
    Written(u64),
    /// Its write failed (a full disk): the call is answered all the same, the failure
    /// counted by the control plane.
    Failed,
    /// The session was deleted: no line (a session made again under its id would inherit it).
    Retired,
    /// The ledger is closed (its server stopping): the call is to go the control plane's way.
    Closed,
}

impl Ledger {
    #[must_use]
    pub fn new() -> Self {
        Self::default()
    }

    fn state(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Open `path` for appending (created `0600` if missing) unless a file is open already,
    /// `header` written first (the counts a new ledger begins with): no line of the lane can
    /// come before it.
    ///
    /// # Errors
    /// The file cannot be opened, or the header written (the ledger stays closed).
    pub fn open(&self, path: &Path, header: &[u8]) -> io::Result<()> {
        let mut state = self.state();
        if state.file.is_none() {
            let mut file = append_to(path)?;
            if !header.is_empty() {
                write_line(&mut file, header)?;
            }
            state.file = Some(file);
        }
        Ok(())
    }

    /// Whether a file is open.
    pub fn is_open(&self) -> bool {
        self.state().file.is_some()
    }

    /// Let the file go: nothing is written until it is opened again.
    pub fn close(&self) {
        self.state().file = None;
    }

    /// Append `data` (whole lines) in one `write`.
    ///
    /// # Errors
    /// No file is open, or the write fails.
    pub fn append(&self, data: &[u8]) -> io::Result<()> {
        let mut state = self.state();
        let file = state
            .file
            .as_mut()
            .ok_or_else(|| io::Error::other("the ledger is not open"))?;
        write_line(file, data)
    }

    /// The lane's line for a call of `session` answered before its turn is recorded: `a SID`,
    /// unless the session is retired (`alive` false, set under this lock by [`Self::retire`]).
    pub fn answered(&self, session: &str, alive: &Arc<AtomicBool>) -> Answered {
        let mut state = self.state();
        let Some(file) = state.file.as_mut() else {
            return Answered::Closed;
        };
        if !alive.load(Ordering::Acquire) {
            return Answered::Retired;
        }
        let line = format!("a {session}\n");
        if write_line(file, line.as_bytes()).is_err() {
            return Answered::Failed;
        }
        state.last += 1;
        let entry = state.last;
        state.unapplied.push_back(Unapplied {
            entry,
            session: session.into(),
            alive: alive.clone(),
        });
        Answered::Written(entry)
    }

    /// A session is deleted: from now on no line of the lane names it (a line being written
    /// is written first).
    pub fn retire(&self, alive: &AtomicBool) {
        let _state = self.state();
        alive.store(false, Ordering::Release);
    }

    /// The control plane knows the lane's line `entry` (what [`Self::answered`] numbered it).
    pub fn applied(&self, entry: u64) {
        let mut state = self.state();
        // (mostly the oldest: calls are handed over about in the order they were answered)
        if let Some(at) = state.unapplied.iter().position(|u| u.entry == entry) {
            state.unapplied.remove(at);
        }
    }

    /// The lane's lines the control plane does not know yet.
    pub fn unapplied(&self) -> usize {
        self.state().unapplied.len()
    }

    /// Put the rewritten ledger `fresh` (written and synced whole: the control plane's
    /// counts) in place of `path` and append to it from now on. The lane's lines the control
    /// plane does not know yet are appended to `fresh` first (under the lock, so none is
    /// written between), but a deleted session's: its count ended with its `n` line.
    ///
    /// # Errors
    /// The append, the rename or the reopening fails (the file in place is then whichever
    /// the rename left, and nothing is appended until it is opened again; `fresh` is the
    /// caller's to remove).
    pub fn replace(&self, fresh: &Path, path: &Path) -> io::Result<()> {
        let mut state = self.state();
        let mut carried = String::new();
        for line in &state.unapplied {
            if line.alive.load(Ordering::Acquire) {
                carried.push_str("a ");
                carried.push_str(&line.session);
                carried.push('\n');
            }
        }
        if !carried.is_empty() {
            write_line(&mut append_to(fresh)?, carried.as_bytes())?;
        }
        state.file = None;
        std::fs::rename(fresh, path)?;
        state.file = Some(append_to(path)?);
        Ok(())
    }
}

fn append_to(path: &Path) -> io::Result<File> {
    OpenOptions::new()
        .append(true)
        .create(true)
        .mode(FILE_MODE)
        .open(path)
}

/// One `write` of `data` (a short write is finished, never split by another writer: the
/// lock is held).
fn write_line(file: &mut File, data: &[u8]) -> io::Result<()> {
    file.write_all(data)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    #[test]
    fn the_lanes_lines_and_the_control_planes_go_to_one_file() {
        let dir = std::env::temp_dir().join(format!("ledger-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("acks.ledger");
        let ledger = Ledger::new();
        let alive = Arc::new(AtomicBool::new(true));
        assert_eq!(ledger.answered("s", &alive), Answered::Closed);
        ledger.open(&path, b"").unwrap();
        let mode = std::fs::metadata(&path).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o600);
        ledger.append(b"b s 0\n").unwrap();
        assert_eq!(ledger.answered("s", &alive), Answered::Written(1));
        assert_eq!(ledger.unapplied(), 1);
        let fresh = dir.join("fresh");
        // a rewrite carries the lane's line the control plane does not know yet
        std::fs::write(&fresh, b"b s 0\n").unwrap();
        ledger.replace(&fresh, &path).unwrap();
        assert_eq!(std::fs::read(&path).unwrap(), b"b s 0\na s\n");
        ledger.applied(1);
        assert_eq!(ledger.unapplied(), 0);
        std::fs::write(&fresh, b"b s 0\np s 1\n").unwrap();
        ledger.replace(&fresh, &path).unwrap();
        // a deleted session's line is not carried: its count ended with its `n` line
        let gone = Arc::new(AtomicBool::new(true));
        assert_eq!(ledger.answered("t", &gone), Answered::Written(2));
        ledger.retire(&gone);
        assert_eq!(ledger.answered("t", &gone), Answered::Retired);
        ledger.append(b"n t\n").unwrap();
        std::fs::write(&fresh, b"b s 0\np s 1\n").unwrap();
        ledger.replace(&fresh, &path).unwrap();
        assert_eq!(ledger.unapplied(), 1);
        ledger.applied(2);
        assert_eq!(ledger.unapplied(), 0);
        ledger.retire(&alive);
        assert_eq!(ledger.answered("s", &alive), Answered::Retired);
        ledger.append(b"n s\n").unwrap();
        assert_eq!(std::fs::read(&path).unwrap(), b"b s 0\np s 1\nn s\n");
        ledger.close();
        assert!(ledger.append(b"x\n").is_err());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}

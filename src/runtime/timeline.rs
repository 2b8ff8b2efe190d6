//! Chrome-trace timeline (`HOROVOD_TIMELINE`), written by rank 0: one trace "process" per tensor
//! name, with NEGOTIATE_<OP> and <OP> spans and the activities inside them, and counter tracks
//! of the metrics (`control`, `data`). The file is a JSON array that Perfetto and
//! chrome://tracing load; it is closed properly at shutdown.

use std::collections::HashMap;

/// Tensor tracks in one timeline; further names share `OTHER_TRACK`, so that a job whose names
/// never repeat does not keep a map entry per operation.
const MAX_TRACKS: usize = 1 << 14;
const OTHER_TRACK: &str = "(other tensors)";
use std::fs::File;
use std::io::{BufWriter, Write};
use std::time::Instant;

pub struct Timeline {
    out: BufWriter<File>,
    start: Instant,
    pids: HashMap<String, usize>,
    mark_cycles: bool,
    /// Votes recorded so far: the id the next `vote` gets.
    votes: u64,
}

fn json_str(s: &str) -> String {
    let mut o = String::with_capacity(s.len() + 2);
    o.push('"');
    for c in s.chars() {
        match c {
            '"' => o.push_str("\\\""),
            '\\' => o.push_str("\\\\"),
            c if (c as u32) < 0x20 => o.push_str(&format!("\\u{:04x}", c as u32)),
            c => o.push(c),
        }
    }
    o.push('"');
    o
}

fn json_list(items: impl Iterator<Item = String>) -> String {
    format!("[{}]", items.collect::<Vec<_>>().join(", "))
}

/// Which batch a `BATCH` record is.
pub enum BatchOf<'a> {
    /// Of the last vote: its members' indices there.
    Vote(&'a [usize]),
    /// Of the frozen offline plan: its index there and its tensors.
    Plan(usize, &'a [String]),
}

impl Timeline {
    pub fn create(path: &str, mark_cycles: bool) -> std::io::Result<Timeline> {
        let mut out = BufWriter::new(File::create(path)?);
        out.write_all(b"[\n")?;
        let since_epoch = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_micros())
            .unwrap_or(0);
        writeln!(
            out,
            "{{\"name\": \"process_name\", \"ph\": \"M\", \"pid\": 0, \"args\": {{\"name\": \"ferrovod\", \"start_time_since_epoch_in_micros\": {since_epoch}}}}},"
        )?;
        Ok(Timeline {
            out,
            start: Instant::now(),
            pids: HashMap::new(),
            mark_cycles,
            votes: 0,
        })
    }

    fn ts(&self) -> u128 {
        self.start.elapsed().as_micros()
    }

    fn pid(&mut self, name: &str) -> usize {
        if let Some(p) = self.pids.get(name) {
            return *p;
        }
        if self.pids.len() >= MAX_TRACKS && name != OTHER_TRACK {
            // names that never repeat (unnamed ops): later ones share one track
            return self.pid(OTHER_TRACK);
        }
        let pid = self.pids.len() + 1;
        self.pids.insert(name.to_string(), pid);
        let _ = writeln!(
            self.out,
            "{{\"name\": \"process_name\", \"ph\": \"M\", \"pid\": {pid}, \"args\": {{\"name\": {}}}}},\n{{\"name\": \"process_sort_index\", \"ph\": \"M\", \"pid\": {pid}, \"args\": {{\"sort_index\": {pid}}}}},",
            json_str(name)
        );
        pid
    }

    /// Opens a span named `span` on tensor `tensor`'s track.
    pub fn begin(&mut self, tensor: &str, span: &str) {
        let pid = self.pid(tensor);
        let ts = self.ts();
        let _ = writeln!(
            self.out,
            "{{\"name\": {}, \"ph\": \"B\", \"ts\": {ts}, \"pid\": {pid}, \"tid\": 0}},",
            json_str(span)
        );
    }

    /// Closes the innermost open span on tensor `tensor`'s track; `args` become its details.
    pub fn end(&mut self, tensor: &str, args: Option<(&str, &str)>) {
        let pid = self.pid(tensor);
        let ts = self.ts();
        let args = args
            .map(|(dtype, shape)| {
                format!(
                    ", \"args\": {{\"dtype\": {}, \"shape\": {}}}",
                    json_str(dtype),
                    json_str(shape)
                )
            })
            .unwrap_or_default();
        let _ = writeln!(
            self.out,
            "{{\"ph\": \"E\", \"ts\": {ts}, \"pid\": {pid}, \"tid\": 0{args}}},"
        );
    }

    pub fn mark_cycle(&mut self) {
        if self.mark_cycles {
            let ts = self.ts();
            let _ = writeln!(
                self.out,
                "{{\"name\": \"CYCLE_START\", \"ph\": \"i\", \"ts\": {ts}, \"pid\": 0, \"tid\": 0, \"s\": \"g\"}},"
            );
        }
    }

    /// The schedule, on the ferrovod track: a vote's agreed responses of process set `set` in
    /// their agreed order, with the sizes of the learned groups they start with. The batches
    /// that follow (`batch`) belong to it. With `batch`, enough to check a model of the
    /// schedule (`ferrovod-sim`) against what ran: which tensors each collective fused, its
    /// route and its codec.
    pub fn vote(&mut self, set: i32, names: &[&str], groups: &[usize]) {
        let ts = self.ts();
        let vote = self.votes;
        self.votes += 1;
        let names = json_list(names.iter().map(|n| json_str(n)));
        let groups = json_list(groups.iter().map(usize::to_string));
        let _ = writeln!(
            self.out,
            "{{\"name\": \"VOTE\", \"ph\": \"i\", \"ts\": {ts}, \"pid\": 0, \"tid\": 0, \"s\": \"g\", \"args\": {{\"vote\": {vote}, \"set\": {set}, \"tensors\": {names}, \"groups\": {groups}}}}},"
        );
    }

    /// One batch of the last vote: its members (indices into the vote's tensors), and how it
    /// runs. A batch of a frozen offline plan has no vote: `members` are then its plan index
    /// and its tensors are named.
    pub fn batch(&mut self, of: BatchOf<'_>, route: &str, codec: &str) {
        let ts = self.ts();
        let whose = match of {
            BatchOf::Vote(members) => format!(
                "\"vote\": {}, \"members\": {}",
                self.votes.saturating_sub(1),
                json_list(members.iter().map(usize::to_string))
            ),
            BatchOf::Plan(index, names) => format!(
                "\"plan\": {index}, \"tensors\": {}",
                json_list(names.iter().map(|n| json_str(n)))
            ),
        };
        let _ = writeln!(
            self.out,
            "{{\"name\": \"BATCH\", \"ph\": \"i\", \"ts\": {ts}, \"pid\": 0, \"tid\": 0, \"s\": \"g\", \"args\": {{{whose}, \"route\": {}, \"codec\": {}}}}},",
            json_str(route),
            json_str(codec)
        );
    }

    /// Counter tracks ("C" events) on the ferrovod track: the metrics, so the control plane's
    /// cost shows next to the tensors' spans.
    pub fn counters(&mut self, m: &crate::runtime::metrics::MetricsSnapshot) {
        let ts = self.ts();
        let _ = writeln!(
            self.out,
            "{{\"name\": \"control\", \"ph\": \"C\", \"ts\": {ts}, \"pid\": 0, \"args\": {{\"collectives\": {}, \"bytes\": {}, \"negotiation_ms\": {:.3}}}}},\n{{\"name\": \"data\", \"ph\": \"C\", \"ts\": {ts}, \"pid\": 0, \"args\": {{\"collectives\": {}, \"MiB\": {:.3}, \"fused_batches\": {}}}}},",
            m.control_collectives,
            m.control_bytes,
            m.negotiation_ns as f64 / 1e6,
            m.data_collectives,
            m.data_bytes as f64 / (1 << 20) as f64,
            m.fused_batches
        );
    }

    /// An activity sink for a collective over `names`: each phase it is told of closes the
    /// previous one on every tensor's track and opens the next (`None` closes the last).
    pub fn activities<'a>(
        timeline: &'a mut Option<Timeline>,
        names: &'a [String],
    ) -> impl FnMut(Option<&'static str>) + 'a {
        let mut open = false;
        move |act| {
            if let Some(t) = timeline.as_mut() {
                for n in names {
                    if open {
                        t.end(n, None);
                    }
                    if let Some(a) = act {
                        t.begin(n, a);
                    }
                }
            }
            open = act.is_some();
        }
    }

    pub fn flush(&mut self) {
        let _ = self.out.flush();
    }

    /// Ends the array so the file is strict JSON.
    pub fn close(mut self) {
        let ts = self.ts();
        let _ = writeln!(
            self.out,
            "{{\"name\": \"timeline_end\", \"ph\": \"i\", \"ts\": {ts}, \"pid\": 0, \"tid\": 0, \"s\": \"g\"}}\n]"
        );
        let _ = self.out.flush();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tracks_are_bounded() {
        let path =
            std::env::temp_dir().join(format!("ferrovod-timeline-{}.json", std::process::id()));
        let mut t = Timeline::create(path.to_str().unwrap(), false).unwrap();
        for k in 0..MAX_TRACKS + 100 {
            t.begin(&format!("noname.{k}"), "ALLREDUCE");
        }
        assert_eq!(t.pids.len(), MAX_TRACKS + 1);
        assert_eq!(t.pid("noname.1"), 2);
        assert_eq!(t.pid("noname.new"), t.pid(OTHER_TRACK));
        drop(t);
        let _ = std::fs::remove_file(path);
    }
}

//! RabbitMQ's `x-consistent-hash` exchange as a harness target, driven through
//! a real AMQP 0-9-1 client (lapin).
//!
//! Each experiment declares its own exchange and queues under a name unique to
//! this run, binds every queue with weight `"1"` (binding key = weight, as the
//! plugin intends), and deletes them when it ends. Counts are read with a
//! passive queue declare after every publish was confirmed; placements are
//! read by draining each queue, each message's body being its index in the
//! batch, so copies of one key stay distinguishable.
//!
//! The target never talks to any host but the one in the URL it is given, and
//! every wait is bounded (connect timeout, confirm window, drain count).

use std::io::{Read, Write};
use std::net::{TcpStream, ToSocketAddrs};
use std::str::FromStr;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use lapin::options::{
    BasicGetOptions, BasicPublishOptions, ConfirmSelectOptions, ExchangeDeclareOptions,
    ExchangeDeleteOptions, QueueBindOptions, QueueDeclareOptions, QueueDeleteOptions,
    QueuePurgeOptions,
};
use lapin::publisher_confirm::{Confirmation, PublisherConfirm};
use lapin::types::FieldTable;
use lapin::uri::AMQPUri;
use lapin::{BasicProperties, Channel, Connection, ConnectionProperties, ExchangeKind};

use super::{Observer, Target};
use crate::error::ChxError;

/// Exchange type the plugin registers.
pub const EXCHANGE_TYPE: &str = "x-consistent-hash";
/// Binding key of every queue: its weight, equal for all.
pub const BINDING_WEIGHT: &str = "1";
/// Bound on the TCP connect and on reading the broker's greeting.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// Publishes in flight before waiting for their confirms; bounds client memory
/// and how much one slow confirm can hide.
pub const CONFIRM_WINDOW: usize = 2000;
/// Largest greeting frame read from the broker while probing.
const GREETING_BYTES_MAX: usize = 64 * 1024;

/// A connected broker.
pub struct RabbitTarget {
    url: String,
    version: String,
    connection: Connection,
    channel: Channel,
    run_id: String,
    exchange: Option<String>,
    /// Logical queue names, in binding order.
    queues: Vec<String>,
}

impl std::fmt::Debug for RabbitTarget {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RabbitTarget")
            .field("url", &self.url)
            .field("version", &self.version)
            .field("exchange", &self.exchange)
            .field("queues", &self.queues)
            .finish()
    }
}

impl RabbitTarget {
    /// Connects to `url` (`amqp://host:port[/vhost]`). Fails with
    /// [`ChxError::NoBroker`] when nothing speaks AMQP there.
    pub fn connect(url: &str) -> Result<RabbitTarget, ChxError> {
        let version = probe(url)?;
        let amqp = |doing: &str| {
            let url = url.to_string();
            let doing = doing.to_string();
            move |source| ChxError::Amqp { url, doing, source }
        };
        let (connection, channel) = async_global_executor::block_on(async {
            let connection = Connection::connect(url, ConnectionProperties::default())
                .await
                .map_err(amqp("connecting"))?;
            let channel = connection
                .create_channel()
                .await
                .map_err(amqp("opening a channel"))?;
            channel
                .confirm_select(ConfirmSelectOptions::default())
                .await
                .map_err(amqp("enabling publisher confirms"))?;
            Ok::<_, ChxError>((connection, channel))
        })?;
        let nanos = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0);
        Ok(RabbitTarget {
            url: url.to_string(),
            version,
            connection,
            channel,
            run_id: format!("shardq-chx-{}-{:x}", std::process::id(), nanos % (1 << 40)),
            exchange: None,
            queues: Vec::new(),
        })
    }

    /// Closes the connection.
    pub fn close(self) {
        let _ = async_global_executor::block_on(self.connection.close(200, "harness done"));
    }

    fn err(&self, doing: impl Into<String>) -> impl FnOnce(lapin::Error) -> ChxError {
        let url = self.url.clone();
        let doing = doing.into();
        move |source| ChxError::Amqp { url, doing, source }
    }

    fn exchange(&self) -> &str {
        // begin() always runs first; a missing exchange is a harness bug.
        self.exchange
            .as_deref()
            .expect("begin() declares the exchange")
    }

    fn physical(&self, queue: &str) -> String {
        format!("{}.{queue}", self.exchange())
    }

    fn add_queue(&self, queue: &str) -> Result<(), ChxError> {
        let name = self.physical(queue);
        let exchange = self.exchange().to_string();
        async_global_executor::block_on(async {
            self.channel
                .queue_declare(&name, QueueDeclareOptions::default(), FieldTable::default())
                .await
                .map_err(self.err(format!("declaring queue {name}")))?;
            self.channel
                .queue_bind(
                    &name,
                    &exchange,
                    BINDING_WEIGHT,
                    QueueBindOptions::default(),
                    FieldTable::default(),
                )
                .await
                .map_err(self.err(format!("binding queue {name}")))
        })
    }

    fn remove_queue(&self, queue: &str) -> Result<(), ChxError> {
        let name = self.physical(queue);
        let exchange = self.exchange().to_string();
        async_global_executor::block_on(async {
            // Unbind first, as an operator shrinking the ring would; deleting
            // the queue alone would also drop the binding.
            self.channel
                .queue_unbind(&name, &exchange, BINDING_WEIGHT, FieldTable::default())
                .await
                .map_err(self.err(format!("unbinding queue {name}")))?;
            self.channel
                .queue_delete(&name, QueueDeleteOptions::default())
                .await
                .map_err(self.err(format!("deleting queue {name}")))?;
            Ok(())
        })
    }

    /// Publishes `bodies[i]` with routing key `keys[i]` for every message,
    /// waiting for confirms one window at a time. Every message must be
    /// acked and routed (published as mandatory, so unroutable ones come back).
    fn publish(
        &self,
        messages: &mut dyn Iterator<Item = (String, Vec<u8>)>,
        obs: &mut dyn Observer,
    ) -> Result<u64, ChxError> {
        let exchange = self.exchange().to_string();
        let mut sent = 0u64;
        let mut window: Vec<PublisherConfirm> = Vec::with_capacity(CONFIRM_WINDOW);
        let mut messages = messages.peekable();
        while messages.peek().is_some() {
            async_global_executor::block_on(async {
                for (key, body) in messages.by_ref().take(CONFIRM_WINDOW) {
                    let confirm = self
                        .channel
                        .basic_publish(
                            &exchange,
                            &key,
                            BasicPublishOptions {
                                mandatory: true,
                                ..BasicPublishOptions::default()
                            },
                            &body,
                            BasicProperties::default(),
                        )
                        .await
                        .map_err(self.err(format!("publishing to {exchange}")))?;
                    window.push(confirm);
                }
                let n = window.len() as u64;
                for confirm in window.drain(..) {
                    match confirm.await.map_err(self.err("waiting for a publisher confirm"))? {
                        Confirmation::Ack(None) => {}
                        Confirmation::Ack(Some(returned)) => {
                            return Err(ChxError::Lost {
                                system: "rabbitmq".into(),
                                detail: format!(
                                    "the exchange returned a message as unroutable (routing key {:?}); is the consistent-hash plugin enabled and are queues bound?",
                                    returned.delivery.routing_key.as_str()
                                ),
                            })
                        }
                        Confirmation::Nack(_) => {
                            return Err(ChxError::Lost {
                                system: "rabbitmq".into(),
                                detail: "the broker nacked a message".into(),
                            })
                        }
                        Confirmation::NotRequested => {
                            return Err(ChxError::Lost {
                                system: "rabbitmq".into(),
                                detail: "publisher confirms are not enabled on the channel".into(),
                            })
                        }
                    }
                }
                sent += n;
                obs.advance(n);
                Ok::<_, ChxError>(())
            })?;
        }
        Ok(sent)
    }

    /// Messages ready in each current queue, by passive declare.
    fn depths(&self) -> Result<Vec<u64>, ChxError> {
        let names: Vec<String> = self.queues.iter().map(|q| self.physical(q)).collect();
        async_global_executor::block_on(async {
            let mut depths = Vec::with_capacity(names.len());
            for name in &names {
                let q = self
                    .channel
                    .queue_declare(
                        name,
                        QueueDeclareOptions {
                            passive: true,
                            ..QueueDeclareOptions::default()
                        },
                        FieldTable::default(),
                    )
                    .await
                    .map_err(self.err(format!("reading the depth of {name}")))?;
                depths.push(u64::from(q.message_count()));
            }
            Ok(depths)
        })
    }

    fn purge_all(&self) -> Result<(), ChxError> {
        let names: Vec<String> = self.queues.iter().map(|q| self.physical(q)).collect();
        async_global_executor::block_on(async {
            for name in &names {
                self.channel
                    .queue_purge(name, QueuePurgeOptions::default())
                    .await
                    .map_err(self.err(format!("purging {name}")))?;
            }
            Ok(())
        })
    }
}

impl Target for RabbitTarget {
    fn system(&self) -> &str {
        "rabbitmq"
    }

    fn version(&self) -> String {
        format!("RabbitMQ {}", self.version)
    }

    fn begin(&mut self, experiment: &str, queues: &[String]) -> Result<(), ChxError> {
        let exchange = format!("{}-{experiment}", self.run_id);
        async_global_executor::block_on(self.channel.exchange_declare(
            &exchange,
            ExchangeKind::Custom(EXCHANGE_TYPE.into()),
            ExchangeDeclareOptions::default(),
            FieldTable::default(),
        ))
        .map_err(self.err(format!(
            "declaring {EXCHANGE_TYPE} exchange {exchange} (is rabbitmq_consistent_hash_exchange enabled?)"
        )))?;
        self.exchange = Some(exchange);
        self.queues.clear();
        self.set_queues(queues)
    }

    fn set_queues(&mut self, queues: &[String]) -> Result<(), ChxError> {
        for gone in self.queues.iter().filter(|q| !queues.contains(q)) {
            self.remove_queue(gone)?;
        }
        for new in queues.iter().filter(|q| !self.queues.contains(q)) {
            self.add_queue(new)?;
        }
        self.queues = queues.to_vec();
        Ok(())
    }

    fn count(
        &mut self,
        keys: &mut dyn Iterator<Item = String>,
        total: u64,
        obs: &mut dyn Observer,
    ) -> Result<Vec<u64>, ChxError> {
        let sent = self.publish(&mut keys.map(|k| (k, Vec::new())), obs)?;
        let depths = self.depths()?;
        self.purge_all()?;
        let held: u64 = depths.iter().sum();
        if sent != total || held != sent {
            return Err(ChxError::Lost {
                system: self.system().into(),
                detail: format!("published {sent} of {total} messages, queues hold {held}"),
            });
        }
        Ok(depths)
    }

    fn place(&mut self, keys: &[String], obs: &mut dyn Observer) -> Result<Vec<usize>, ChxError> {
        let mut messages = keys
            .iter()
            .enumerate()
            .map(|(i, k)| (k.clone(), i.to_string().into_bytes()));
        self.publish(&mut messages, obs)?;
        let depths = self.depths()?;
        let mut placed: Vec<Option<usize>> = vec![None; keys.len()];
        let lost = |detail: String| ChxError::Lost {
            system: "rabbitmq".into(),
            detail,
        };
        for (q, &depth) in depths.iter().enumerate() {
            let name = self.physical(&self.queues[q]);
            // Drain exactly `depth` messages: the bound on this loop.
            for _ in 0..depth {
                let got = async_global_executor::block_on(
                    self.channel
                        .basic_get(&name, BasicGetOptions { no_ack: true }),
                )
                .map_err(self.err(format!("reading from {name}")))?;
                let msg = got
                    .ok_or_else(|| lost(format!("{name} reported {depth} messages but ran dry")))?;
                let index = std::str::from_utf8(&msg.delivery.data)
                    .ok()
                    .and_then(|s| s.parse::<usize>().ok())
                    .filter(|&i| i < keys.len())
                    .ok_or_else(|| lost(format!("{name} held a message this run did not send")))?;
                if placed[index].replace(q).is_some() {
                    return Err(lost(format!("message {index} was delivered twice")));
                }
            }
        }
        let missing = placed.iter().filter(|p| p.is_none()).count();
        if missing > 0 {
            return Err(lost(format!(
                "{missing} of {} messages reached no queue",
                keys.len()
            )));
        }
        Ok(placed
            .into_iter()
            .map(|p| p.unwrap_or(usize::MAX))
            .collect())
    }

    fn end(&mut self) -> Result<(), ChxError> {
        let Some(exchange) = self.exchange.clone() else {
            return Ok(());
        };
        let names: Vec<String> = self.queues.iter().map(|q| self.physical(q)).collect();
        async_global_executor::block_on(async {
            for name in &names {
                self.channel
                    .queue_delete(name, QueueDeleteOptions::default())
                    .await
                    .map_err(self.err(format!("deleting queue {name}")))?;
            }
            self.channel
                .exchange_delete(&exchange, ExchangeDeleteOptions::default())
                .await
                .map_err(self.err(format!("deleting exchange {exchange}")))
        })?;
        self.exchange = None;
        self.queues.clear();
        Ok(())
    }
}

/// Checks that something at `url` speaks AMQP 0-9-1 and returns the broker's
/// version from its greeting (`Connection.Start`'s `version` property), with
/// bounded connect and read times. lapin does not expose the greeting.
pub fn probe(url: &str) -> Result<String, ChxError> {
    let no_broker = |reason: String| ChxError::NoBroker {
        url: url.to_string(),
        reason,
    };
    let uri = AMQPUri::from_str(url).map_err(|e| no_broker(format!("not an AMQP URL: {e}")))?;
    let addr = (uri.authority.host.as_str(), uri.authority.port)
        .to_socket_addrs()
        .map_err(|e| no_broker(format!("cannot resolve {}: {e}", uri.authority.host)))?
        .next()
        .ok_or_else(|| no_broker(format!("{} has no address", uri.authority.host)))?;
    let mut stream = TcpStream::connect_timeout(&addr, CONNECT_TIMEOUT)
        .map_err(|e| no_broker(format!("connecting to {addr}: {e}")))?;
    let io = |e: std::io::Error| no_broker(format!("reading the greeting from {addr}: {e}"));
    stream.set_read_timeout(Some(CONNECT_TIMEOUT)).map_err(io)?;
    stream
        .set_write_timeout(Some(CONNECT_TIMEOUT))
        .map_err(io)?;
    stream.write_all(b"AMQP\x00\x00\x09\x01").map_err(io)?;
    let mut header = [0u8; 7];
    stream.read_exact(&mut header).map_err(io)?;
    if header[0] != 1 {
        return Err(no_broker(format!(
            "{addr} did not answer with an AMQP 0-9-1 method frame"
        )));
    }
    let size = u32::from_be_bytes([header[3], header[4], header[5], header[6]]) as usize;
    if size > GREETING_BYTES_MAX {
        return Err(no_broker(format!("{addr} sent a {size}-byte greeting")));
    }
    let mut payload = vec![0u8; size];
    stream.read_exact(&mut payload).map_err(io)?;
    // The connection is dropped here, before the handshake: the broker logs
    // a closed connection, which is harmless.
    Ok(greeting_version(&payload).unwrap_or_else(|| "unknown".into()))
}

/// The `version` server property of a `Connection.Start` method payload.
fn greeting_version(payload: &[u8]) -> Option<String> {
    let mut r = Reader(payload);
    // class 10 (connection), method 10 (start), then protocol major and minor.
    if r.take(4)? != [0, 10, 0, 10] {
        return None;
    }
    r.take(2)?;
    let table_len = r.u32()? as usize;
    let mut t = Reader(r.take(table_len)?);
    while !t.0.is_empty() {
        let name_len = *t.take(1)?.first()? as usize;
        let name = t.take(name_len)?;
        let kind = *t.take(1)?.first()?;
        let value = match kind {
            b'S' | b'F' | b'A' | b'x' => {
                let n = t.u32()? as usize;
                t.take(n)?
            }
            b't' | b'b' | b'B' => t.take(1)?,
            b's' | b'u' => t.take(2)?,
            b'I' | b'i' | b'f' => t.take(4)?,
            b'D' => t.take(5)?,
            b'l' | b'L' | b'd' | b'T' => t.take(8)?,
            b'V' => &[],
            // An unknown type means we cannot find where the next field starts.
            _ => return None,
        };
        if name == b"version" && kind == b'S' {
            return String::from_utf8(value.to_vec()).ok();
        }
    }
    None
}

/// A cursor over a byte slice whose reads fail (None) instead of panicking.
struct Reader<'a>(&'a [u8]);

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Option<&'a [u8]> {
        if self.0.len() < n {
            return None;
        }
        let (head, tail) = self.0.split_at(n);
        self.0 = tail;
        Some(head)
    }

    fn u32(&mut self) -> Option<u32> {
        let b = self.take(4)?;
        Some(u32::from_be_bytes([b[0], b[1], b[2], b[3]]))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn field(name: &str, kind: u8, value: &[u8]) -> Vec<u8> {
        let mut out = vec![name.len() as u8];
        out.extend_from_slice(name.as_bytes());
        out.push(kind);
        out.extend_from_slice(value);
        out
    }

    fn long_string(s: &str) -> Vec<u8> {
        let mut out = (s.len() as u32).to_be_bytes().to_vec();
        out.extend_from_slice(s.as_bytes());
        out
    }

    fn start(fields: &[Vec<u8>]) -> Vec<u8> {
        let table: Vec<u8> = fields.concat();
        let mut out = vec![0, 10, 0, 10, 0, 9];
        out.extend_from_slice(&(table.len() as u32).to_be_bytes());
        out.extend_from_slice(&table);
        out
    }

    #[test]
    fn greeting_versions() {
        let caps = field("capabilities", b'F', &long_string("\x0cx"));
        let cases: Vec<(Vec<u8>, Option<&str>)> = vec![
            (
                start(&[field("version", b'S', &long_string("3.10.8"))]),
                Some("3.10.8"),
            ),
            (
                start(&[
                    caps.clone(),
                    field("flag", b't', &[1]),
                    field("version", b'S', &long_string("4.0.9")),
                ]),
                Some("4.0.9"),
            ),
            (
                start(&[field("product", b'S', &long_string("RabbitMQ"))]),
                None,
            ),
            (
                start(&[
                    field("odd", b'?', &[1]),
                    field("version", b'S', &long_string("1")),
                ]),
                None,
            ),
            (vec![0, 10, 0, 11, 0, 9, 0, 0, 0, 0], None),
            (vec![0, 10, 0, 10, 0, 9, 0, 0, 0, 99], None),
            (Vec::new(), None),
        ];
        for (payload, want) in cases {
            assert_eq!(greeting_version(&payload).as_deref(), want, "{payload:?}");
        }
    }

    #[test]
    fn probe_reports_no_broker() {
        // Port 1 on loopback: nothing listens there on a normal machine.
        let err = probe("amqp://127.0.0.1:1").unwrap_err().to_string();
        assert!(err.starts_with("no broker at amqp://127.0.0.1:1"), "{err}");
        assert!(err.contains("scripts/rabbitmq.sh start"), "{err}");
        let err = probe("http://x").unwrap_err().to_string();
        assert!(err.contains("not an AMQP URL"), "{err}");
    }
}

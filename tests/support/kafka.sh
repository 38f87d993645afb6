#!/usr/bin/env bash
# Apache Kafka (KRaft, one combined broker+controller node) for tests and the demo, from Maven Central.
#   kafka.sh install               copy Kafka and a log4j2 binding into the cache (once; needs Java 17 and Maven)
#   kafka.sh start DIR PORT [ADVERTISED_PORT]
#                                  format DIR and start a node in the background (pid in DIR/kafka.pid), clients
#                                  on 127.0.0.1:PORT (sent to ADVERTISED_PORT, e.g. a test's proxy); waits until
#                                  it accepts connections
#   kafka.sh stop DIR              stop it
# Not yet the tests' broker (they use broker.sh, tansu): this is the first step of moving them to Apache Kafka.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
. "$here/env.sh"

KAFKA_VERSION="$(sed -n 's:.*<kafka.version>\(.*\)</kafka.version>.*:\1:p' "$here/kafka/pom.xml")"
KAFKA_LIB="${OUTBOXD_KAFKA_LIB:-$OUTBOXD_CACHE/kafka-$KAFKA_VERSION/lib}"

install() {
  if [ -f "$KAFKA_LIB/kafka_2.13-$KAFKA_VERSION.jar" ]; then
    return 0
  fi
  if ! command -v java >/dev/null || ! command -v mvn >/dev/null; then
    apt-get install -y -q openjdk-17-jre-headless maven >/dev/null
  fi
  echo "copying Apache Kafka $KAFKA_VERSION and its dependencies into $KAFKA_LIB (once)"
  rm -rf "$KAFKA_LIB.partial"
  mvn -q -f "$here/kafka/pom.xml" dependency:copy-dependencies \
    -DincludeScope=runtime -DoutputDirectory="$KAFKA_LIB.partial"
  mv "$KAFKA_LIB.partial" "$KAFKA_LIB"
}

free_port() {
  python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

cmd="${1:?usage: kafka.sh install|start|stop ...}"
case "$cmd" in
  install) install ;;
  start)
    dir="${2:?DIR required}"
    port="${3:?PORT required}"
    advertised="${4:-$port}"
    [ -f "$KAFKA_LIB/kafka_2.13-$KAFKA_VERSION.jar" ] || { echo "Kafka not found in $KAFKA_LIB: run tests/support/kafka.sh install" >&2; exit 1; }
    mkdir -p "$dir"
    dir="$(cd "$dir" && pwd)"
    controller="$(free_port)"
    cat >"$dir/server.properties" <<EOF
process.roles=broker,controller
node.id=1
controller.quorum.voters=1@127.0.0.1:$controller
listeners=PLAINTEXT://127.0.0.1:$port,CONTROLLER://127.0.0.1:$controller
advertised.listeners=PLAINTEXT://127.0.0.1:$advertised
controller.listener.names=CONTROLLER
inter.broker.listener.name=PLAINTEXT
listener.security.protocol.map=PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT
log.dirs=$dir/data
offsets.topic.replication.factor=1
transaction.state.log.replication.factor=1
transaction.state.log.min.isr=1
group.initial.rebalance.delay.ms=0
auto.create.topics.enable=false
EOF
    cat >"$dir/log4j2.properties" <<EOF
rootLogger.level=INFO
rootLogger.appenderRef.file.ref=file
appender.file.type=File
appender.file.name=file
appender.file.fileName=$dir/kafka.log
appender.file.layout.type=PatternLayout
appender.file.layout.pattern=[%d] %p %m (%c)%n
EOF
    if [ ! -f "$dir/data/meta.properties" ]; then
      cluster_id="$(java -cp "$KAFKA_LIB/*" kafka.tools.StorageTool random-uuid 2>/dev/null | tail -1)"
      java -Dlog4j2.configurationFile="$dir/log4j2.properties" -cp "$KAFKA_LIB/*" \
        kafka.tools.StorageTool format -t "$cluster_id" -c "$dir/server.properties" >"$dir/format.log" 2>&1 \
        || { cat "$dir/format.log" >&2; exit 1; }
    fi
    nohup java -Xmx512m -Dlog4j2.configurationFile="$dir/log4j2.properties" -cp "$KAFKA_LIB/*" \
      kafka.Kafka "$dir/server.properties" >"$dir/stdout.log" 2>&1 &
    echo $! >"$dir/kafka.pid"
    for _ in $(seq 1 300); do
      if grep -q "Kafka Server started" "$dir/kafka.log" 2>/dev/null; then
        exit 0
      fi
      kill -0 "$(cat "$dir/kafka.pid")" 2>/dev/null || { cat "$dir/stdout.log" "$dir/kafka.log" >&2; exit 1; }
      sleep 0.2
    done
    echo "Kafka did not start on port $port within 60 s" >&2; tail -20 "$dir/kafka.log" >&2; exit 1
    ;;
  stop)
    dir="${2:?DIR required}"
    if [ -f "$dir/kafka.pid" ]; then
      pid="$(cat "$dir/kafka.pid")"
      kill "$pid" 2>/dev/null || true
      for _ in $(seq 1 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
      kill -9 "$pid" 2>/dev/null || true
      rm -f "$dir/kafka.pid"
    fi
    ;;
  *) echo "unknown command $cmd" >&2; exit 2 ;;
esac

#!/usr/bin/env bash
# Apache Kafka (KRaft, combined broker+controller nodes) for tests and the demo, from Maven Central.
#   kafka.sh install               copy Kafka and a log4j2 binding into the cache (once; needs Java 17 and Maven),
#                                  and compile the admin tool of start-secure (tests/support/kafka/KafkaAdmin.java)
#   kafka.sh start DIR PORT [ADVERTISED_PORT]
#                                  format DIR and start one node in the background (pid in DIR/kafka.pid),
#                                  clients on 127.0.0.1:PORT (sent to ADVERTISED_PORT, e.g. a test's proxy);
#                                  waits until it has started. OUTBOXD_KAFKA_PROPERTIES (lines of key=value)
#                                  is added to a new node's server.properties (e.g. a test's quick retention
#                                  check); no other node gets it
#   kafka.sh start-cluster DIR PORT1 PORT2 PORT3
#                                  three nodes (DIR/node1..3, one cluster, a static quorum of all three),
#                                  replication factor 3 and min.insync.replicas=2 by default
#   kafka.sh start-secure DIR PORT one node whose clients must use SASL_SSL on 127.0.0.1:PORT: SCRAM-SHA-512,
#                                  a server certificate (SAN IP:127.0.0.1, DNS:localhost) from a CA made in
#                                  DIR/tls (clients trust DIR/tls/ca.crt), StandardAuthorizer with
#                                  allow.everyone.if.no.acl.found=false and the super user admin (password
#                                  $KAFKA_ADMIN_PASSWORD, default admin-secret). Its own listeners (inter-broker,
#                                  controller) are PLAINTEXT on loopback; their principal, User:ANONYMOUS, is a
#                                  super user too (the broker talks to itself as it), so the inter-broker port
#                                  (in DIR/plaintext.port) also serves tools that read back without credentials.
#                                  DIR/admin.properties: the super user's client settings (Java clients)
#   kafka.sh add-user DIR NAME PASSWORD
#                                  a SCRAM-SHA-512 user on a secure node; returns once it can log in
#   kafka.sh allow DIR NAME OPERATIONS RESOURCE_TYPE RESOURCE [LITERAL|PREFIXED]
#                                  ALLOW ACLs for User:NAME, e.g. `allow DIR app WRITE,CREATE TOPIC orders`;
#                                  returns once the broker enforces them
#   kafka.sh start-node DIR        start a stopped node again (DIR, or DIR/nodeN of a cluster)
#   kafka.sh stop DIR              stop a node (DIR, or DIR/nodeN of a cluster)
#   kafka.sh kill DIR              SIGKILL one node (DIR, or DIR/nodeN) and wait until it is gone; start-node
#                                  brings it back with the same data (a crash, for failover tests)
# The tests, the demo and the benchmark reach it through broker.sh.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
. "$here/env.sh"

KAFKA_VERSION="$(sed -n 's:.*<kafka.version>\(.*\)</kafka.version>.*:\1:p' "$here/kafka/pom.xml")"
KAFKA_LIB="${OUTBOXD_KAFKA_LIB:-$OUTBOXD_CACHE/kafka-$KAFKA_VERSION/lib}"

install() {
  # A JDK (javac compiles the admin tool); Maven only to fetch the jars.
  local missing=()
  command -v javac >/dev/null || missing+=(openjdk-17-jdk-headless)
  if [ ! -f "$KAFKA_LIB/kafka_2.13-$KAFKA_VERSION.jar" ] && ! command -v mvn >/dev/null; then
    missing+=(maven)
  fi
  if [ ${#missing[@]} -gt 0 ]; then
    if [ "$(id -u)" -ne 0 ]; then
      echo "Apache Kafka needs Java 17 (a JDK) and Maven: install ${missing[*]}" >&2
      exit 1
    fi
    echo "installing ${missing[*]} (Debian packages)"
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
  fi
  if [ -f "$KAFKA_LIB/kafka_2.13-$KAFKA_VERSION.jar" ]; then
    admin_tool >/dev/null
    broker_class_archive
    return 0
  fi
  echo "copying Apache Kafka $KAFKA_VERSION and its dependencies into $KAFKA_LIB (once)"
  rm -rf "$KAFKA_LIB.partial"
  mvn -q -f "$here/kafka/pom.xml" dependency:copy-dependencies \
    -DincludeScope=runtime -DoutputDirectory="$KAFKA_LIB.partial"
  mv "$KAFKA_LIB.partial" "$KAFKA_LIB"
  admin_tool >/dev/null
  broker_class_archive
}

require_kafka() {
  [ -f "$KAFKA_LIB/kafka_2.13-$KAFKA_VERSION.jar" ] || {
    echo "Kafka not found in $KAFKA_LIB: run tests/support/kafka.sh install" >&2
    exit 1
  }
}

# free_port: a port nothing listens on, from 10000..20000: below the kernel's ephemeral range, whose ports
# outgoing connections take meanwhile (the tests' own servers get theirs from 20000..32768, support/mod.rs).
free_port() {
  python3 -c 'import random, socket
for _ in range(1000):
    port = random.randrange(10000, 20000)
    s = socket.socket()
    try:
        s.bind(("127.0.0.1", port))
    except OSError:
        continue
    print(port)
    break
else:
    raise SystemExit("no free port in 10000..20000")'
}

# new_uuid: a random Kafka Uuid as StorageTool random-uuid prints it (a version 4 UUID, URL-safe base64
# without padding, never starting with "-"), without starting a JVM for it.
new_uuid() {
  python3 -c 'import base64, uuid
while True:
    s = base64.urlsafe_b64encode(uuid.uuid4().bytes).rstrip(b"=").decode()
    if not s.startswith("-"): break
print(s)'
}

# write_node_config DIR NODE_ID PORT ADVERTISED_PORT CONTROLLER_PORT VOTERS REPLICATION [PLAINTEXT_PORT]
# With PLAINTEXT_PORT, clients get a SASL_SSL listener on PORT (see start-secure) and the broker's own
# traffic a PLAINTEXT one on PLAINTEXT_PORT.
write_node_config() {
  local dir="$1" id="$2" port="$3" advertised="$4" controller="$5" voters="$6" replication="$7"
  local plaintext="${8:-}"
  local min_isr=1
  if [ "$replication" -ge 3 ]; then min_isr=2; fi
  if [ -z "$plaintext" ]; then
    cat >"$dir/server.properties" <<EOF
listeners=PLAINTEXT://127.0.0.1:$port,CONTROLLER://127.0.0.1:$controller
advertised.listeners=PLAINTEXT://127.0.0.1:$advertised
listener.security.protocol.map=PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT
EOF
  else
    cat >"$dir/server.properties" <<EOF
listeners=SASL_SSL://127.0.0.1:$port,PLAINTEXT://127.0.0.1:$plaintext,CONTROLLER://127.0.0.1:$controller
advertised.listeners=SASL_SSL://127.0.0.1:$advertised,PLAINTEXT://127.0.0.1:$plaintext
listener.security.protocol.map=SASL_SSL:SASL_SSL,PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT
sasl.enabled.mechanisms=SCRAM-SHA-512
listener.name.sasl_ssl.scram-sha-512.sasl.jaas.config=org.apache.kafka.common.security.scram.ScramLoginModule required;
ssl.keystore.type=PKCS12
ssl.keystore.location=$dir/tls/server.p12
ssl.keystore.password=$KEYSTORE_PASSWORD
ssl.key.password=$KEYSTORE_PASSWORD
authorizer.class.name=org.apache.kafka.metadata.authorizer.StandardAuthorizer
super.users=User:admin;User:ANONYMOUS
allow.everyone.if.no.acl.found=false
EOF
  fi
  cat >>"$dir/server.properties" <<EOF
process.roles=broker,controller
node.id=$id
controller.quorum.voters=$voters
controller.listener.names=CONTROLLER
inter.broker.listener.name=PLAINTEXT
log.dirs=$dir/data
default.replication.factor=$replication
min.insync.replicas=$min_isr
offsets.topic.replication.factor=$replication
transaction.state.log.replication.factor=$replication
transaction.state.log.min.isr=$min_isr
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
}

# format_node DIR CLUSTER_ID [STORAGE_TOOL_ARGS...]: once per storage directory. With STORAGE_TOOL_ARGS
# (e.g. --add-scram) StorageTool formats it; without, the formatted state is a copy of the bootstrap
# checkpoint StorageTool wrote once for this Kafka version (feature levels only: no cluster or node id) and a
# meta.properties of our own, which saves a JVM start per broker the tests start.
format_node() {
  local dir="$1" cluster_id="$2"
  shift 2
  if [ -f "$dir/data/meta.properties" ]; then return 0; fi
  if [ $# -gt 0 ]; then
    storage_tool_format "$dir" "$cluster_id" "$@"
    return 0
  fi
  local template
  template="$(bootstrap_template "$dir")"
  mkdir -p "$dir/data"
  cp "$template/bootstrap.checkpoint" "$dir/data/"
  local node_id
  node_id="$(sed -n 's/^node.id=//p' "$dir/server.properties")"
  printf 'node.id=%s\ndirectory.id=%s\nversion=1\ncluster.id=%s\n' "$node_id" "$(new_uuid)" "$cluster_id" \
    >"$dir/data/meta.properties"
}

storage_tool_format() {
  local dir="$1" cluster_id="$2"
  shift 2
  java -Dlog4j2.configurationFile="$dir/log4j2.properties" -cp "$KAFKA_LIB/*" \
    kafka.tools.StorageTool format -t "$cluster_id" -c "$dir/server.properties" "$@" >"$dir/format.log" 2>&1 \
    || { cat "$dir/format.log" >&2; exit 1; }
}

# bootstrap_template NODE_DIR: the cache directory holding the bootstrap checkpoint StorageTool writes for
# this Kafka version (made once, from NODE_DIR's configuration); prints its path.
bootstrap_template() {
  local template
  template="$(dirname "$KAFKA_LIB")/bootstrap"
  if [ ! -f "$template/bootstrap.checkpoint" ]; then
    local partial
    partial="$(mktemp -d "$template.partial.XXXXXX")"
    sed "s|^log.dirs=.*|log.dirs=$partial/data|" "$1/server.properties" >"$partial/server.properties"
    cp "$1/log4j2.properties" "$partial/"
    storage_tool_format "$partial" "$(new_uuid)" >&2
    mkdir -p "$partial/out"
    cp "$partial/data/bootstrap.checkpoint" "$partial/out/"
    # Another test may have made it at the same moment: keep whichever landed first.
    mv -T "$partial/out" "$template" 2>/dev/null || true
    rm -rf "$partial"
  fi
  echo "$template"
}

KEYSTORE_PASSWORD=test-keystore
ADMIN_PASSWORD="${KAFKA_ADMIN_PASSWORD:-admin-secret}"

# make_certificates DIR: DIR/tls/ca.crt (a CA made here) and the broker's key and certificate, signed by it
# for IP:127.0.0.1 and DNS:localhost, in a PKCS12 keystore.
make_certificates() {
  local tls="$1/tls"
  mkdir -p "$tls"
  (
    cd "$tls"
    ec=(-newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes)
    openssl req -x509 -days 2 -subj "/CN=outboxd test Kafka CA" "${ec[@]}" -keyout ca.key -out ca.crt
    openssl req -subj /CN=localhost "${ec[@]}" -keyout server.key -out server.csr
    printf 'subjectAltName=IP:127.0.0.1,DNS:localhost\n' >san.ext
    openssl x509 -req -in server.csr -CA ca.crt -CAkey ca.key -CAcreateserial -days 2 -extfile san.ext \
      -out server.crt
    openssl pkcs12 -export -in server.crt -inkey server.key -name broker \
      -passout "pass:$KEYSTORE_PASSWORD" -out server.p12
  ) >"$1/tls.log" 2>&1 || { cat "$1/tls.log" >&2; exit 1; }
}

# admin_tool: KafkaAdmin.java compiled once per version of its source, in the cache next to Kafka's jars;
# prints the directory of its classes.
admin_tool() {
  local source="$here/kafka/KafkaAdmin.java"
  local classes
  classes="$(dirname "$KAFKA_LIB")/admin-$(sha256sum "$source" | cut -c1-16)"
  if [ ! -f "$classes/KafkaAdmin.class" ]; then
    command -v javac >/dev/null || { echo "javac not found: install openjdk-17-jdk-headless" >&2; exit 1; }
    local partial
    partial="$(mktemp -d "$classes.partial.XXXXXX")"
    javac -nowarn -d "$partial" -cp "$KAFKA_LIB/*" "$source" >&2
    # Another test may have compiled it at the same moment: keep whichever landed first.
    mv -T "$partial" "$classes" 2>/dev/null || rm -rf "$partial"
  fi
  echo "$classes"
}

# admin DIR ARGS...: KafkaAdmin against the secure node in DIR, as its super user.
admin() {
  local dir="$1"
  shift
  [ -f "$dir/admin.properties" ] || { echo "$dir is not a node started by start-secure" >&2; exit 1; }
  local classes
  classes="$(admin_tool)"
  # A short-lived client: the quick JIT tier and the serial collector start it in half the time.
  java -Xmx256m -XX:TieredStopAtLevel=1 -XX:+UseSerialGC -Dlog4j2.configurationFile="$dir/admin-log4j2.properties" \
    -cp "$classes:$KAFKA_LIB/*" KafkaAdmin "$dir/admin.properties" "$@"
}

# The broker's JVM. The tests start some 400 brokers that each live a minute under a light load, and on 2
# cores the JVM's start-up was a fifth of the suite's CPU: the quick JIT tier, the serial collector and a
# class-data archive of Kafka's classes (made once by install) start one in a third of the CPU. The benchmark,
# whose broker must not be the bottleneck, sets OUTBOXD_BROKER_JVM_OPTS="" for the JVM's defaults.
BROKER_CDS="$(dirname "$KAFKA_LIB")/broker.jsa"
broker_jvm_opts() {
  if [ -n "${OUTBOXD_BROKER_JVM_OPTS+set}" ]; then
    echo "$OUTBOXD_BROKER_JVM_OPTS"
    return 0
  fi
  local opts="-XX:TieredStopAtLevel=1 -XX:+UseSerialGC"
  # A stale archive (another JVM, other jars) is only ignored by the JVM, with a warning in stdout.log.
  if [ -f "$BROKER_CDS" ]; then opts="$opts -XX:SharedArchiveFile=$BROKER_CDS"; fi
  echo "$opts"
}

# broker_class_archive: BROKER_CDS, the classes a broker loads up to "Kafka Server started", dumped by one
# broker started and stopped here; made again when the JVM changes.
broker_class_archive() {
  local jvm
  jvm="$(java -version 2>&1 | sed -n 1p)"
  if [ -f "$BROKER_CDS" ] && [ "$(cat "$BROKER_CDS.jvm" 2>/dev/null)" = "$jvm" ]; then return 0; fi
  local work port controller
  work="$(mktemp -d)"
  port="$(free_port)"
  controller="$(free_port)"
  write_node_config "$work" 1 "$port" "$port" "$controller" "1@127.0.0.1:$controller" 1
  format_node "$work" "$(new_uuid)"
  rm -f "$BROKER_CDS" "$BROKER_CDS.jvm"
  OUTBOXD_BROKER_JVM_OPTS="-XX:TieredStopAtLevel=1 -XX:+UseSerialGC -XX:ArchiveClassesAtExit=$BROKER_CDS.partial" \
    launch_node "$work"
  stop_node "$work"
  if [ -f "$BROKER_CDS.partial" ]; then
    mv "$BROKER_CDS.partial" "$BROKER_CDS"
    echo "$jvm" >"$BROKER_CDS.jvm"
  else
    echo "note: no class-data archive for the broker (the JVM did not write one); brokers start without it" >&2
  fi
  rm -rf "$work"
}

# launch_node DIR [nowait]
launch_node() {
  local dir="$1"
  : >"$dir/kafka.log"
  # shellcheck disable=SC2046 # the options are words
  nohup java -Xmx512m $(broker_jvm_opts) -Dlog4j2.configurationFile="$dir/log4j2.properties" -cp "$KAFKA_LIB/*" \
    kafka.Kafka "$dir/server.properties" >"$dir/stdout.log" 2>&1 &
  echo $! >"$dir/kafka.pid"
  if [ "${2:-}" != nowait ]; then wait_node "$dir"; fi
}

wait_node() {
  local dir="$1"
  for _ in $(seq 1 300); do
    if grep -q "Kafka Server started" "$dir/kafka.log" 2>/dev/null; then return 0; fi
    kill -0 "$(cat "$dir/kafka.pid")" 2>/dev/null || { cat "$dir/stdout.log" "$dir/kafka.log" >&2; exit 1; }
    sleep 0.2
  done
  echo "Kafka node in $dir did not start within 60 s" >&2
  tail -20 "$dir/kafka.log" >&2
  exit 1
}

stop_node() {
  local dir="$1"
  if [ -f "$dir/kafka.pid" ]; then
    local pid
    pid="$(cat "$dir/kafka.pid")"
    kill "$pid" 2>/dev/null || true
    for _ in $(seq 1 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    kill -9 "$pid" 2>/dev/null || true
    rm -f "$dir/kafka.pid"
  fi
}

# kill_node DIR: SIGKILL, no shutdown (no controlled leader hand-over, unflushed log segments).
kill_node() {
  local dir="$1"
  if [ -f "$dir/kafka.pid" ]; then
    local pid
    pid="$(cat "$dir/kafka.pid")"
    kill -9 "$pid" 2>/dev/null || true
    for _ in $(seq 1 100); do
      kill -0 "$pid" 2>/dev/null || break
      # A zombie is gone for our purpose (it holds no port and no lock).
      if [ "$(ps -o stat= -p "$pid" 2>/dev/null | cut -c1)" = Z ]; then break; fi
      sleep 0.1
    done
    rm -f "$dir/kafka.pid"
  fi
}

cmd="${1:?usage: kafka.sh install|start|start-cluster|start-secure|add-user|allow|revoke|start-node|stop|kill ...}"
case "$cmd" in
  install) install ;;
  start)
    dir="${2:?DIR required}"
    port="${3:?PORT required}"
    advertised="${4:-$port}"
    require_kafka
    mkdir -p "$dir"
    dir="$(cd "$dir" && pwd)"
    if [ ! -f "$dir/server.properties" ]; then
      controller="$(free_port)"
      write_node_config "$dir" 1 "$port" "$advertised" "$controller" "1@127.0.0.1:$controller" 1
      if [ -n "${OUTBOXD_KAFKA_PROPERTIES:-}" ]; then
        printf '%s\n' "$OUTBOXD_KAFKA_PROPERTIES" >>"$dir/server.properties"
      fi
      format_node "$dir" "$(new_uuid)"
    fi
    launch_node "$dir"
    ;;
  start-cluster)
    dir="${2:?DIR required}"
    ports=("${3:?PORT1 required}" "${4:?PORT2 required}" "${5:?PORT3 required}")
    require_kafka
    mkdir -p "$dir"
    dir="$(cd "$dir" && pwd)"
    controllers=("$(free_port)" "$(free_port)" "$(free_port)")
    voters="1@127.0.0.1:${controllers[0]},2@127.0.0.1:${controllers[1]},3@127.0.0.1:${controllers[2]}"
    cluster_id="$(new_uuid)"
    for n in 1 2 3; do
      node="$dir/node$n"
      mkdir -p "$node"
      write_node_config "$node" "$n" "${ports[$((n - 1))]}" "${ports[$((n - 1))]}" \
        "${controllers[$((n - 1))]}" "$voters" 3
      format_node "$node" "$cluster_id"
    done
    # A static quorum elects a controller only once a majority runs: start all three, then wait for each.
    for n in 1 2 3; do launch_node "$dir/node$n" nowait; done
    for n in 1 2 3; do wait_node "$dir/node$n"; done
    ;;
  start-secure)
    dir="${2:?DIR required}"
    port="${3:?PORT required}"
    require_kafka
    mkdir -p "$dir"
    dir="$(cd "$dir" && pwd)"
    if [ ! -f "$dir/server.properties" ]; then
      make_certificates "$dir"
      controller="$(free_port)"
      plaintext="$(free_port)"
      write_node_config "$dir" 1 "$port" "$port" "$controller" "1@127.0.0.1:$controller" 1 "$plaintext"
      echo "$plaintext" >"$dir/plaintext.port"
      cat >"$dir/admin.properties" <<EOF
bootstrap.servers=127.0.0.1:$port
security.protocol=SASL_SSL
sasl.mechanism=SCRAM-SHA-512
sasl.jaas.config=org.apache.kafka.common.security.scram.ScramLoginModule required username="admin" password="$ADMIN_PASSWORD";
ssl.truststore.type=PEM
ssl.truststore.location=$dir/tls/ca.crt
EOF
      cat >"$dir/admin-log4j2.properties" <<EOF
rootLogger.level=WARN
rootLogger.appenderRef.stderr.ref=stderr
appender.stderr.type=Console
appender.stderr.name=stderr
appender.stderr.target=SYSTEM_ERR
appender.stderr.layout.type=PatternLayout
appender.stderr.layout.pattern=%p %m (%c)%n
EOF
      format_node "$dir" "$(new_uuid)" --add-scram "SCRAM-SHA-512=[name=admin,password=$ADMIN_PASSWORD]"
    fi
    admin_tool >/dev/null
    launch_node "$dir"
    ;;
  add-user)
    admin "${2:?DIR required}" add-user "${3:?NAME required}" "${4:?PASSWORD required}"
    ;;
  allow | revoke)
    dir="${2:?DIR required}"
    shift 2
    admin "$dir" "$cmd" "$@"
    ;;
  start-node)
    require_kafka
    launch_node "${2:?DIR required}"
    ;;
  stop)
    dir="${2:?DIR required}"
    stop_node "$dir"
    for node in "$dir"/node1 "$dir"/node2 "$dir"/node3; do
      if [ -d "$node" ]; then stop_node "$node"; fi
    done
    ;;
  kill) kill_node "${2:?DIR required}" ;;
  *) echo "unknown command $cmd" >&2; exit 2 ;;
esac

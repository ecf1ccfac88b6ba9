# Stand-ins for the parts of Homebrew's formula DSL that Formula/mlxspec.rb uses, so the tests can
# load the formula with plain Ruby, run its install method against a recording virtualenv and run
# its test block against a real mlxspec. Homebrew itself is macOS-only here; this is not a copy of
# it, only the calls the formula makes, each behaving as Homebrew documents it.
#
#   ruby formula_harness.rb FORMULA describe   # metadata as JSON
#   ruby formula_harness.rb FORMULA install    # what install did, as JSON (needs HARNESS_BIN)
#   ruby formula_harness.rb FORMULA test       # runs the test block (needs HARNESS_BIN)
require "json"
require "pathname"
require "tmpdir"

LOG = [] # rubocop:disable Style/MutableConstant

module Language
  module Python
    module Virtualenv
      # Homebrew: makes libexec a venv, pip-installs every resource not in `without`, then the
      # formula's own buildpath, and links its new executables into bin.
      def virtualenv_install_with_resources(without: nil, **options)
        skip = Array(without)
        unknown = skip - resources.map(&:name)
        raise ArgumentError, "Resource \"#{unknown.first}\" is not defined in formula" unless unknown.empty?

        LOG << { "call" => "virtualenv_install_with_resources", "without" => skip, "options" => options.keys }
        resources.reject { |r| skip.include?(r.name) }.each do |r|
          LOG << { "call" => "pip_install_resource", "resource" => r.name, "url" => r.url }
        end
        Venv.new
      end
    end
  end
end

class Venv
  def pip_install(target)
    path = target.to_s
    LOG << { "call" => "pip_install", "path" => path, "basename" => File.basename(path), "exists" => File.file?(path) }
  end
end

class Resource
  attr_reader :name

  def initialize(name, &block)
    @name = name
    @specs = {}
    instance_eval(&block)
  end

  def url(val = nil, **specs)
    return @url if val.nil?

    @url = val
    @specs = specs
  end

  def sha256(val = nil)
    return @sha256 if val.nil?

    @sha256 = val
  end

  attr_reader :specs

  # Homebrew stages into a fresh directory: an archive unpacked, or with `using: :nounzip` the
  # downloaded file itself under its url's basename. Only the latter is reproduced.
  def stage
    Dir.mktmpdir do |dir|
      Dir.chdir(dir) do
        File.write(File.basename(@url), "") if @specs[:using] == :nounzip
        yield self
      end
    end
  end

  def to_h
    { "name" => name, "url" => url, "sha256" => sha256, "using" => @specs[:using]&.to_s }
  end
end

class AssertionFailed < StandardError; end

class Formula
  class << self
    def meta
      @meta ||= { "depends_on" => [], "resources" => {} }
    end

    %w[desc homepage url sha256 license].each do |field|
      define_method(field) { |value, **_specs| meta[field] = value }
    end

    def depends_on(dep)
      meta["depends_on"] << (dep.is_a?(Hash) ? dep.to_h { |k, v| [k.to_s, v.to_s] } : dep.to_s)
    end

    def resource(name, &block)
      raise ArgumentError, "resource #{name} defined twice" if meta["resources"].key?(name)

      meta["resources"][name] = Resource.new(name, &block)
    end

    def service(&block)
      meta["service"] = !block.nil?
    end

    def test(&block)
      @test_block = block
    end

    attr_reader :test_block
  end

  def resources
    self.class.meta["resources"].values
  end

  def resource(name)
    self.class.meta["resources"].fetch(name)
  end

  # Homebrew takes the version from the url's file name
  def version
    self.class.meta["url"][/-(\d[^-]*)\.tar\.gz\z/, 1]
  end

  def bin
    Pathname(ENV.fetch("HARNESS_BIN"))
  end

  # Homebrew's prefix for logs and data (HOMEBREW_PREFIX/var); the Apple Silicon default
  def var
    Pathname("/opt/homebrew/var")
  end

  def shell_output(cmd, result = 0)
    out = `#{cmd}`
    raise AssertionFailed, "`#{cmd}` exited #{$?.exitstatus}, expected #{result}" if $?.exitstatus != result

    out
  end

  # Homebrew's :typer format runs `EXE --show-completion SHELL` with shell detection off
  def generate_completions_from_executable(executable, shell_parameter_format: nil, shells: nil)
    raise ArgumentError, "harness knows only :typer" unless shell_parameter_format == :typer

    (shells || [:bash, :zsh, :fish, :pwsh]).each do |shell|
      env = { "SHELL" => shell.to_s, "_TYPER_COMPLETE_TEST_DISABLE_SHELL_DETECTION" => "1" }
      out = IO.popen(env, [executable.to_s, "--show-completion", shell.to_s], err: [:child, :out], &:read)
      raise AssertionFailed, "completion for #{shell} failed: #{out}" unless $?.success? && !out.strip.empty?

      LOG << { "call" => "completion", "shell" => shell.to_s, "script" => out }
    end
  end

  # the minitest assertions test blocks use
  def assertion(ok, message)
    LOG << { "call" => "assert", "ok" => ok, "message" => message }
    raise AssertionFailed, message unless ok
  end

  def assert_match(pattern, text, msg = nil)
    ok = pattern.is_a?(Regexp) ? pattern.match?(text) : text.include?(pattern)
    assertion(ok, msg || "expected #{text.inspect} to match #{pattern.inspect}")
  end

  def assert_equal(expected, actual, msg = nil)
    assertion(expected == actual, msg || "expected #{expected.inspect}, got #{actual.inspect}")
  end

  def refute_nil(value, msg = nil)
    assertion(!value.nil?, msg || "expected a value, got nil")
  end

  def assert_operator(left, operator, right, msg = nil)
    ok = !left.nil? && left.public_send(operator, right)
    assertion(ok, msg || "expected #{left.inspect} #{operator} #{right.inspect}")
  end

  def assert_predicate(value, predicate, msg = nil)
    assertion(value.public_send(predicate), msg || "expected #{value.inspect} to be #{predicate}")
  end
end

formula_path, action = ARGV
load formula_path
klass = Object.const_get(File.basename(formula_path, ".rb").split(/[-_]/).map(&:capitalize).join)
meta = klass.meta
begin
  case action
  when "describe"
    puts JSON.generate(meta.merge(
      "class"                 => klass.name,
      "virtualenv"            => klass.include?(Language::Python::Virtualenv),
      "version"               => klass.new.version,
      "install_defined"       => klass.method_defined?(:install),
      "resources"             => meta["resources"].values.map(&:to_h),
      "test_block_defined"    => !klass.test_block.nil?,
      "caveats"               => klass.method_defined?(:caveats) ? klass.new.caveats : nil,
    ))
  when "install"
    klass.new.install
    puts JSON.generate(LOG)
  when "test"
    klass.new.instance_eval(&klass.test_block)
    puts JSON.generate(LOG)
  else
    abort "usage: ruby formula_harness.rb FORMULA describe|install|test"
  end
rescue AssertionFailed => e
  warn "formula #{action} failed: #{e.message}"
  puts JSON.generate(LOG)
  exit 1
end
